"""``TorchEstimator``: fit a PyTorch model on a Spark DataFrame with Horovod, and ``TorchModel``,
the Spark ML ``Model`` whose ``transform`` predicts (upstream's ``horovod.spark.torch``).

The data path works on current stacks without petastorm (which does not install beside NumPy 2
and PyArrow 15+): ``fit`` writes the selected columns as Parquet into the ``Store`` (one file per
rank: ``repartition(num_proc)``), each rank reads its files with PyArrow, and the ranks agree on
the number of steps per epoch (the smallest shard's), so no rank waits in a collective another
never joins. Vector columns (``VectorAssembler``'s) become arrays on the way.

Training on each rank: the model, optimizer and loss travel together (one pickle, so the
optimizer keeps pointing at the model's parameters); rank 0's weights and optimizer state are
broadcast; ``hvd.DistributedOptimizer`` averages gradients; the epoch's loss (and validation
loss) are averaged over ranks; rank 0 writes the checkpoint and the history into the store.
The driver loads the checkpoint into its copy of the model.

``TorchModel.transform`` adds one column per label (``<label>__output``: a double for one
output per row, else an array of doubles), predicting with ``mapInPandas`` on the executors.

Must not touch: the driver's imports beyond PySpark and torch (the tasks import
``horovod.torch``).
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
from pyspark.sql import DataFrame
from pyspark.sql import types as T

from horovod.spark.common.data import array_column, as_arrays, read_shard
from horovod.spark.common.estimator import HorovodEstimator, HorovodModel


class TorchEstimator(HorovodEstimator):
    """Fits ``model`` with ``optimizer`` and ``loss`` on ``feature_cols`` -> ``label_cols`` of
    a DataFrame, on ``num_proc`` Horovod ranks (Spark tasks)."""

    def __init__(
        self,
        num_proc: int | None = None,
        model: Any = None,
        optimizer: Any = None,
        loss: Callable[..., Any] | None = None,
        loss_weights: Sequence[float] | None = None,
        input_shapes: Sequence[Sequence[int]] | None = None,
        **kwargs: Any,
    ) -> None:
        """The framework's own arguments here; the common ones (``feature_cols``,
        ``label_cols``, ``batch_size``, ``epochs``, ``validation``, ``store``, ``backend``,
        ``run_id``, ``shuffle``, ``random_seed``, ``verbose``) as ``HorovodEstimator``'s."""
        super().__init__(num_proc=num_proc, model=model, optimizer=optimizer, loss=loss, **kwargs)
        self.loss_weights = list(loss_weights) if loss_weights is not None else None
        self.input_shapes = [list(s) for s in input_shapes] if input_shapes else None

    def _fit(self, dataset: DataFrame) -> TorchModel:
        run = self._prepare(dataset)
        spec = {
            "train": run.train,
            "val": run.val,
            "features": self.feature_cols,
            "labels": self.label_cols,
            "shapes": self.input_shapes,
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "shuffle": self.shuffle,
            "seed": self.random_seed or 0,
            "loss_weights": self.loss_weights,
            "checkpoint": run.store.get_checkpoint_path(run.run_id),
            "logs": run.store.get_logs_path(run.run_id),
            "verbose": self.verbose,
            "store": run.store,
        }
        payload = cloudpickle.dumps((self.model, self.optimizer, self.loss))
        results = run.backend.run(_train_on_rank, args=(payload, spec))
        import torch

        trained = copy.deepcopy(self.model)
        checkpoint = run.store.read(run.store.get_checkpoint_path(run.run_id))
        state = torch.load(io.BytesIO(checkpoint), map_location="cpu")
        trained.load_state_dict(state["model"])
        return TorchModel(
            model=trained,
            feature_cols=self.feature_cols,
            label_cols=self.label_cols,
            input_shapes=self.input_shapes,
            history=results[0]["history"],
            run_id=run.run_id,
        )


def _train_on_rank(payload: bytes, spec: dict) -> dict:
    """One rank's training (runs in a Spark task)."""
    import numpy as np
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    model, optimizer, loss_fn = cloudpickle.loads(payload)
    rank, size = hvd.rank(), hvd.size()
    cols = spec["features"] + spec["labels"]
    data = read_shard(spec["train"], cols, rank, size)
    val = read_shard(spec["val"], cols, rank, size) if spec["val"] else None

    def tensors(block: dict, idx: Any) -> tuple[list, list]:
        feats = []
        for i, c in enumerate(spec["features"]):
            x = torch.from_numpy(block[c][idx])
            if spec["shapes"]:
                x = x.reshape(spec["shapes"][i])
            feats.append(x)
        labels = [torch.from_numpy(block[c][idx]) for c in spec["labels"]]
        return feats, labels

    def batch_loss(block: dict, idx: Any) -> Any:
        feats, labels = tensors(block, idx)
        out = model(*feats)
        outs = out if isinstance(out, (list, tuple)) else [out]
        weights = spec["loss_weights"] or [1.0] * len(labels)
        return sum(
            w * loss_fn(o.reshape(lab.shape) if o.numel() == lab.numel() else o, lab)
            for w, o, lab in zip(weights, outs, labels, strict=False)
        )

    rows = len(data[cols[0]])
    # Every rank runs the same number of steps: the smallest shard's.
    steps = int(hvd.allreduce(torch.tensor(math.ceil(rows / spec["batch_size"])), op=hvd.Min))
    if steps == 0:
        raise ValueError(
            f"rank {rank} has no training rows: the DataFrame has too few rows for "
            f"{size} ranks (num_proc)"
        )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    dist = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    rng = np.random.default_rng(spec["seed"] + rank)
    history: dict[str, list[float]] = {"loss": []}
    if val is not None:
        history["val_loss"] = []
    for epoch in range(spec["epochs"]):
        model.train()
        order = rng.permutation(rows) if spec["shuffle"] else np.arange(rows)
        total = 0.0
        for s in range(steps):
            idx = order[(s * spec["batch_size"]) % rows :][: spec["batch_size"]]
            dist.zero_grad()
            loss = batch_loss(data, idx)
            loss.backward()
            dist.step()
            total += float(loss.detach())
        history["loss"].append(float(hvd.allreduce(torch.tensor(total / steps), name="loss")))
        if val is not None:
            model.eval()
            vrows = len(val[cols[0]])
            with torch.no_grad():
                vloss = float(batch_loss(val, np.arange(vrows))) if vrows else 0.0
            # weighted by rows: ranks' shards differ in size
            pair = hvd.allreduce(torch.tensor([vloss * vrows, float(vrows)]), op=hvd.Sum)
            weighted, counted = pair.tolist()
            history["val_loss"].append(weighted / max(counted, 1.0))
        if rank == 0 and spec["verbose"]:
            print(
                f"epoch {epoch + 1}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in history.items())
            )
    if rank == 0:
        store = spec["store"]
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
        store.write(spec["checkpoint"], buf.getvalue())
        store.write(os.path.join(spec["logs"], "history.json"), json.dumps(history).encode())
    return {"rank": rank, "history": history}


class TorchModel(HorovodModel):
    """A model ``TorchEstimator.fit`` trained: ``transform(df)`` adds ``<label>__output``
    columns with its predictions."""

    def __init__(
        self,
        model: Any = None,
        feature_cols: Sequence[str] = (),
        label_cols: Sequence[str] = (),
        input_shapes: Sequence[Sequence[int]] | None = None,
        history: dict | None = None,
        run_id: str | None = None,
        output_cols: Sequence[str] | None = None,
    ) -> None:
        super().__init__(model, feature_cols, label_cols, history, run_id, output_cols)
        self.input_shapes = input_shapes

    def _transform(self, dataset: DataFrame) -> DataFrame:
        import numpy as np
        import torch

        as_arrays(dataset, self.feature_cols)  # checks the columns exist
        vector_cols = [
            c for c in self.feature_cols if type(dataset.schema[c].dataType).__name__ == "VectorUDT"
        ]
        source = dataset
        for c in vector_cols:
            source = source.withColumn(f"__hvd_{c}", array_column(dataset, c))
        inputs = [f"__hvd_{c}" if c in vector_cols else c for c in self.feature_cols]
        # One output per row is a double, more an array: find out on one row of zeros.
        sample = source.select(*inputs).limit(1).collect()
        if not sample:
            widths = [1] * len(self.output_cols)
        else:
            with torch.no_grad():
                out = self.model(
                    *self._tensors(
                        [[list(v) if isinstance(v, (list, tuple)) else v for v in sample[0]]]
                    )
                )
            outs = out if isinstance(out, (list, tuple)) else [out]
            widths = [int(np.prod(o.shape[1:])) if o.dim() > 1 else 1 for o in outs]
        fields = list(source.schema.fields) + [
            T.StructField(c, T.DoubleType() if w == 1 else T.ArrayType(T.DoubleType()))
            for c, w in zip(self.output_cols, widths, strict=False)
        ]
        schema = T.StructType(fields)
        blob = cloudpickle.dumps((self.model, self.input_shapes))
        outputs, dropped = list(self.output_cols), [f"__hvd_{c}" for c in vector_cols]

        def predict(batches: Any) -> Any:
            import torch as th

            net, shapes = cloudpickle.loads(blob)
            net.eval()
            for pdf in batches:
                if len(pdf) == 0:
                    for name in outputs:
                        pdf[name] = []
                    yield pdf
                    continue
                cols = []
                for i, c in enumerate(inputs):
                    x = th.tensor(np.stack([np.asarray(v, np.float32).reshape(-1) for v in pdf[c]]))
                    cols.append(x.reshape(shapes[i]) if shapes else x)
                with th.no_grad():
                    out = net(*cols)
                outs = out if isinstance(out, (list, tuple)) else [out]
                for name, o in zip(outputs, outs, strict=False):
                    flat = o.reshape(len(pdf), -1).double().numpy()
                    pdf[name] = flat[:, 0] if flat.shape[1] == 1 else list(flat)
                yield pdf

        result = source.mapInPandas(predict, schema=schema)
        return result.drop(*dropped) if dropped else result

    def _tensors(self, rows: list) -> list:
        import torch

        cols = []
        for i in range(len(self.feature_cols)):
            x = torch.tensor(
                [[float(v) for v in (r[i] if isinstance(r[i], list) else [r[i]])] for r in rows]
            )
            cols.append(x.reshape(self.input_shapes[i]) if self.input_shapes else x)
        return cols
