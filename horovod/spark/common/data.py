"""The estimators' data path (shared by ``horovod.spark.torch`` and ``horovod.spark.keras``):
DataFrame columns -> Parquet in the store, one file per rank -> each rank's rows as NumPy
arrays through PyArrow (no petastorm: it does not install beside NumPy 2 and PyArrow 15+).

Must not touch: a training framework (arrays only).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Any

from pyspark.sql import DataFrame


def array_column(df: DataFrame, col: str) -> Any:
    """Column ``col`` of ``df`` as an expression: a vector column turned into an array of
    doubles, any other as it is."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT

    if isinstance(df.schema[col].dataType, VectorUDT):
        return vector_to_array(df[col])
    return df[col]


def as_arrays(df: DataFrame, cols: Sequence[str]) -> DataFrame:
    """``cols`` of ``df``, vector columns turned into arrays of doubles."""
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"columns {missing} are not in the DataFrame (it has {df.columns})")
    return df.select(*[array_column(df, c).alias(c) for c in cols])


def write_shards(df: DataFrame, cols: Sequence[str], path: str, ranks: int) -> None:
    """``cols`` of ``df`` as Parquet at ``path``, one file per rank (vectors as arrays)."""
    as_arrays(df, cols).repartition(ranks).write.mode("overwrite").parquet(path)


def prepare(
    dataset: DataFrame,
    cols: Sequence[str],
    validation: float | str | None,
    seed: int,
    store: Any,
    run_id: str,
    ranks: int,
) -> tuple[str, str | None]:
    """Split off the validation rows (a fraction, or a boolean column's true rows) and write
    both parts into the store; (training data path, validation data path or None)."""
    if isinstance(validation, str):
        if validation not in dataset.columns:
            raise ValueError(f"validation column {validation!r} is not in the DataFrame")
        train, val = dataset.filter(~dataset[validation]), dataset.filter(dataset[validation])
    elif validation:
        train, val = dataset.randomSplit([1 - validation, validation], seed=seed)
    else:
        train, val = dataset, None
    train_path = store.get_train_data_path(run_id)
    write_shards(train, cols, train_path, ranks)
    if val is None:
        return train_path, None
    val_path = store.get_val_data_path(run_id)
    write_shards(val, cols, val_path, ranks)
    return train_path, val_path


def read_shard(path: str, cols: Sequence[str], rank: int, size: int) -> dict[str, Any]:
    """This rank's rows of the Parquet files at ``path`` (files ``rank::size``): column ->
    2-D float32 array (one row per sample)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted(glob.glob(os.path.join(path, "*.parquet")))
    mine = files[rank::size]
    tables = [pq.read_table(f, columns=list(cols)) for f in mine]
    table = pa.concat_tables(tables) if tables else None
    out = {}
    for c in cols:
        if table is None or table.num_rows == 0:
            out[c] = np.zeros((0, 1), np.float32)
            continue
        column = table.column(c).combine_chunks()
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            width = len(column[0].as_py())
            out[c] = np.asarray(column.flatten(), np.float32).reshape(-1, width)
        else:
            out[c] = np.asarray(column, np.float32).reshape(-1, 1)
    return out
