"""What the Torch and Keras estimators share: the arguments every estimator takes, their
checks, the data preparation of ``fit`` (``prepare``: the store's Parquet shards), and the
fitted ``Model``'s accessors (``getModel``, ``getHistory``, ``getRunId``).

Must not touch: a training framework (the subclasses own theirs).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.ml import Estimator, Model
from pyspark.sql import DataFrame

from horovod.spark.common.backend import SparkBackend
from horovod.spark.common.data import prepare
from horovod.spark.common.store import Store


@dataclass
class Prepared:
    """A fit's run: its backend, id, store and data paths."""

    backend: SparkBackend
    run_id: str
    store: Store
    train: str
    val: str | None


class HorovodEstimator(Estimator):
    """Upstream's common estimator arguments (``num_proc`` ... ``verbose``); unknown upstream
    arguments are accepted and not used (docs/spark.md)."""

    def __init__(
        self,
        num_proc: int | None = None,
        model: Any = None,
        optimizer: Any = None,
        loss: Any = None,
        feature_cols: Sequence[str] | None = None,
        label_cols: Sequence[str] | None = None,
        batch_size: int = 32,
        epochs: int = 1,
        validation: float | str | None = None,
        store: Store | None = None,
        backend: SparkBackend | None = None,
        run_id: str | None = None,
        shuffle: bool = True,
        random_seed: int | None = None,
        verbose: int = 1,
        **_upstream: Any,
    ) -> None:
        super().__init__()
        self.num_proc, self.model, self.optimizer, self.loss = num_proc, model, optimizer, loss
        self.feature_cols = list(feature_cols or [])
        self.label_cols = list(label_cols or [])
        self.batch_size, self.epochs = int(batch_size), int(epochs)
        self.validation, self.store, self.backend = validation, store, backend
        self.run_id, self.shuffle, self.random_seed = run_id, shuffle, random_seed
        self.verbose = verbose

    def _prepare(self, dataset: DataFrame) -> Prepared:
        """Check the arguments, then write the training (and validation) rows to the store."""
        name = type(self).__name__
        missing = [n for n in ("model", "optimizer", "loss", "store") if getattr(self, n) is None]
        missing += [n for n in ("feature_cols", "label_cols") if not getattr(self, n)]
        if missing:
            raise ValueError(f"{name} needs {', '.join(missing)}")
        if self.batch_size < 1 or self.epochs < 1:
            raise ValueError(f"{name}: batch_size and epochs must be at least 1")
        v = self.validation
        if isinstance(v, float) and not 0 < v < 1:
            raise ValueError(f"{name}: validation must be in (0, 1), got {v}")
        store = self.store
        assert store is not None
        backend = self.backend or SparkBackend(num_proc=self.num_proc)
        run_id = self.run_id or f"run_{uuid.uuid4().hex[:12]}"
        train, val = prepare(
            dataset,
            self.feature_cols + self.label_cols,
            self.validation,
            self.random_seed or 0,
            store,
            run_id,
            backend.num_processes(),
        )
        return Prepared(backend, run_id, store, train, val)


class HorovodModel(Model):
    """A fitted model: the framework's model, the columns, the history and the run id;
    ``transform`` adds ``<label>__output`` columns (the subclasses predict)."""

    def __init__(
        self,
        model: Any = None,
        feature_cols: Sequence[str] = (),
        label_cols: Sequence[str] = (),
        history: dict | None = None,
        run_id: str | None = None,
        output_cols: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.feature_cols, self.label_cols = list(feature_cols), list(label_cols)
        self.history = history or {}
        self.run_id = run_id
        self.output_cols = list(output_cols or [f"{c}__output" for c in self.label_cols])

    def getModel(self) -> Any:  # noqa: N802 - upstream's name
        return self.model

    def getHistory(self) -> dict:  # noqa: N802
        return self.history

    def getRunId(self) -> str | None:  # noqa: N802
        return self.run_id
