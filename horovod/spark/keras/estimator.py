"""``KerasEstimator``: fit a Keras model on a Spark DataFrame with Horovod, and ``KerasModel``,
the Spark ML ``Model`` whose ``transform`` predicts (upstream's ``horovod.spark.keras``).

The data path is the Torch estimator's (``horovod.spark.common.data``: Parquet per rank, read
with PyArrow). The model travels as its architecture (``to_json``) and weights, the optimizer
and loss as Keras's own serializations, so nothing depends on pickling a live Keras object. On
each rank: the model is rebuilt, compiled with ``hvd.DistributedOptimizer`` (the
``horovod.tensorflow.keras`` wrapper), and fitted on exactly ``steps x batch_size`` rows (the
smallest shard's steps, rows wrapping around), so every rank runs the same number of steps;
``BroadcastGlobalVariablesCallback(0)`` starts all ranks from rank 0's weights and
``MetricAverageCallback`` averages the epoch's metrics over ranks. Rank 0 writes the weights
and the history into the store; ``fit`` rebuilds the model with them.

``KerasModel.transform`` adds ``<label>__output`` columns, predicting with ``mapInPandas``.

Must not touch: the driver's imports beyond PySpark and Keras (the tasks import
``horovod.tensorflow.keras``).
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from pyspark.sql import DataFrame
from pyspark.sql import types as T

from horovod.spark.common.data import array_column, as_arrays, read_shard
from horovod.spark.common.estimator import HorovodEstimator, HorovodModel


def _pack(model: Any) -> tuple[str, bytes]:
    buf = io.BytesIO()
    np.savez(buf, *model.get_weights())
    return model.to_json(), buf.getvalue()


def _unpack(arch: str, weights: bytes) -> Any:
    import keras

    model = keras.models.model_from_json(arch)
    data = np.load(io.BytesIO(weights))
    model.set_weights([data[f"arr_{i}"] for i in range(len(data.files))])
    return model


class KerasEstimator(HorovodEstimator):
    """Fits a Keras ``model`` with ``optimizer`` and ``loss`` on ``feature_cols`` ->
    ``label_cols`` of a DataFrame, on ``num_proc`` Horovod ranks (Spark tasks)."""

    def __init__(
        self,
        num_proc: int | None = None,
        model: Any = None,
        optimizer: Any = None,
        loss: Any = None,
        metrics: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """The framework's own arguments here; the common ones (``feature_cols``,
        ``label_cols``, ``batch_size``, ``epochs``, ``validation``, ``store``, ``backend``,
        ``run_id``, ``shuffle``, ``random_seed``, ``verbose``) as ``HorovodEstimator``'s."""
        super().__init__(num_proc=num_proc, model=model, optimizer=optimizer, loss=loss, **kwargs)
        self.metrics = list(metrics or [])

    def _fit(self, dataset: DataFrame) -> KerasModel:
        import keras

        run = self._prepare(dataset)
        arch, weights = _pack(self.model)
        spec = {
            "train": run.train,
            "val": run.val,
            "features": self.feature_cols,
            "labels": self.label_cols,
            "arch": arch,
            "weights": weights,
            "optimizer": keras.optimizers.serialize(self.optimizer),
            "loss": self.loss if isinstance(self.loss, str) else keras.losses.serialize(self.loss),
            "metrics": [
                m if isinstance(m, str) else keras.metrics.serialize(m) for m in self.metrics
            ],
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "shuffle": self.shuffle,
            "seed": self.random_seed or 0,
            "store": run.store,
            "weights_path": os.path.join(run.store.get_run_path(run.run_id), "weights.npz"),
            "logs": run.store.get_logs_path(run.run_id),
        }
        results = run.backend.run(_train_on_rank, args=(spec,))
        trained = _unpack(arch, run.store.read(spec["weights_path"]))
        return KerasModel(
            model=trained,
            feature_cols=self.feature_cols,
            label_cols=self.label_cols,
            history=results[0]["history"],
            run_id=run.run_id,
        )


def _train_on_rank(spec: dict) -> dict:
    """One rank's training (runs in a Spark task)."""
    import keras

    import horovod.numpy as hnp
    import horovod.tensorflow.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    cols = spec["features"] + spec["labels"]
    data = read_shard(spec["train"], cols, rank, size)
    rows = len(data[cols[0]])
    # (horovod.numpy: the same job, on arrays; Keras's module has no Min)
    steps = int(hnp.allreduce(np.array([math.ceil(rows / spec["batch_size"])]), op=hnp.Min)[0])
    if steps == 0:
        raise ValueError(
            f"rank {rank} has no training rows: the DataFrame has too few rows for "
            f"{size} ranks (num_proc)"
        )
    rng = np.random.default_rng(spec["seed"] + rank)
    take = np.arange(steps * spec["batch_size"]) % rows  # the same steps on every rank
    if spec["shuffle"]:
        take = rng.permutation(rows)[take]

    def inputs(block: dict, idx: Any) -> tuple[Any, Any]:
        xs = [block[c][idx] for c in spec["features"]]
        ys = [block[c][idx] for c in spec["labels"]]
        return (xs[0] if len(xs) == 1 else xs), (ys[0] if len(ys) == 1 else ys)

    x, y = inputs(data, take)
    model = _unpack(spec["arch"], spec["weights"])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.deserialize(spec["optimizer"]))
    loss = spec["loss"] if isinstance(spec["loss"], str) else keras.losses.deserialize(spec["loss"])
    metrics = [m if isinstance(m, str) else keras.metrics.deserialize(m) for m in spec["metrics"]]
    model.compile(optimizer=optimizer, loss=loss, metrics=metrics)
    validation_data = None
    if spec["val"]:
        val = read_shard(spec["val"], cols, rank, size)
        if len(val[cols[0]]):
            validation_data = inputs(val, np.arange(len(val[cols[0]])))
    fit = model.fit(
        x,
        y,
        batch_size=spec["batch_size"],
        epochs=spec["epochs"],
        shuffle=spec["shuffle"],
        validation_data=validation_data,
        callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
        ],
        verbose=0,
    )
    history = {k: [float(v) for v in vals] for k, vals in fit.history.items()}
    if rank == 0:
        store = spec["store"]
        buf = io.BytesIO()
        np.savez(buf, *model.get_weights())
        store.write(spec["weights_path"], buf.getvalue())
        store.write(os.path.join(spec["logs"], "history.json"), json.dumps(history).encode())
    return {"rank": rank, "history": history}


class KerasModel(HorovodModel):
    """A model ``KerasEstimator.fit`` trained: ``transform(df)`` adds ``<label>__output``
    columns with its predictions."""

    def _transform(self, dataset: DataFrame) -> DataFrame:
        as_arrays(dataset, self.feature_cols)  # checks the columns exist
        # The features as arrays in columns of their own, dropped again after prediction.
        arrays = {c: f"__hvd_{c}" for c in self.feature_cols}
        src = dataset
        for c in self.feature_cols:
            src = src.withColumn(arrays[c], array_column(dataset, c))
        outs = self.model.outputs
        widths = [int(np.prod([d for d in o.shape[1:] if d is not None]) or 1) for o in outs]
        schema = T.StructType(
            list(dataset.schema.fields)
            + [
                T.StructField(c, T.DoubleType() if w == 1 else T.ArrayType(T.DoubleType()))
                for c, w in zip(self.output_cols, widths, strict=False)
            ]
        )
        arch, weights = _pack(self.model)
        inputs, outputs = [arrays[c] for c in self.feature_cols], list(self.output_cols)

        def predict(batches: Any) -> Any:
            net = _unpack(arch, weights)
            for pdf in batches:
                if len(pdf) == 0:
                    for name in outputs:
                        pdf[name] = []
                    yield pdf.drop(columns=inputs)
                    continue
                xs = [
                    np.stack([np.asarray(v, np.float32).reshape(-1) for v in pdf[c]])
                    for c in inputs
                ]
                pred = net.predict(xs[0] if len(xs) == 1 else xs, verbose=0)
                preds = pred if isinstance(pred, list) else [pred]
                for name, p in zip(outputs, preds, strict=False):
                    flat = np.asarray(p, np.float64).reshape(len(pdf), -1)
                    pdf[name] = flat[:, 0] if flat.shape[1] == 1 else list(flat)
                yield pdf.drop(columns=inputs)

        return src.mapInPandas(predict, schema=schema)
