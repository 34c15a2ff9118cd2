"""Where a Spark estimator keeps a run's data, checkpoints and logs (upstream's
``horovod.spark.common.store``).

``Store.create(path)`` returns a ``LocalStore`` for a local directory (``/data/store`` or
``file:///data/store``). Layout under the prefix::

    intermediate_train_data.<run>/     the training rows, Parquet, written by the driver
    intermediate_val_data.<run>/       the validation rows (when validation is asked for)
    runs/<run>/checkpoint.pt           the trained model (rank 0 writes it)
    runs/<run>/logs/history.json       loss per epoch (rank 0)

On a cluster the directory must be one every executor and the driver see (NFS, a mounted
bucket). Other file systems (``hdfs://``, ``s3://``, ``dbfs:/``) are refused with a message:
mount them and pass the mount point.

Must not touch: the training runtime (it only names and reads paths).
"""

from __future__ import annotations

import os
import shutil
import urllib.parse
from typing import Any


class Store:
    """A prefix path with upstream's accessors (``get_checkpoint_path`` ...)."""

    @staticmethod
    def create(prefix_path: str, *args: Any, **kwargs: Any) -> Store:
        scheme = urllib.parse.urlparse(prefix_path).scheme
        if scheme in ("", "file"):
            return LocalStore(prefix_path, *args, **kwargs)
        raise NotImplementedError(
            f"Store.create({prefix_path!r}): only local directories (or file://) are supported; "
            "mount the file system and pass the mount point"
        )

    def __init__(self, prefix_path: str) -> None:
        self.prefix_path = prefix_path

    # upstream's accessors --------------------------------------------------------------
    def get_train_data_path(self, idx: Any = None) -> str:
        return self._path(f"intermediate_train_data{'' if idx is None else '.' + str(idx)}")

    def get_val_data_path(self, idx: Any = None) -> str:
        return self._path(f"intermediate_val_data{'' if idx is None else '.' + str(idx)}")

    def get_test_data_path(self, idx: Any = None) -> str:
        return self._path(f"intermediate_test_data{'' if idx is None else '.' + str(idx)}")

    def get_runs_path(self) -> str:
        return self._path("runs")

    def get_run_path(self, run_id: str) -> str:
        return os.path.join(self.get_runs_path(), run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        return os.path.join(self.get_run_path(run_id), self.get_checkpoint_filename())

    def get_checkpoint_filename(self) -> str:
        return "checkpoint.pt"

    def get_logs_path(self, run_id: str) -> str:
        return os.path.join(self.get_run_path(run_id), self.get_logs_subdir())

    def get_logs_subdir(self) -> str:
        return "logs"

    def _path(self, name: str) -> str:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def read(self, path: str) -> bytes:
        raise NotImplementedError

    def write(self, path: str, data: bytes) -> None:
        raise NotImplementedError


class LocalStore(Store):
    """A store in a local (or mounted) directory."""

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        parsed = urllib.parse.urlparse(prefix_path)
        local = parsed.path if parsed.scheme == "file" else prefix_path
        super().__init__(os.path.abspath(local))
        os.makedirs(self.prefix_path, exist_ok=True)

    def _path(self, name: str) -> str:
        return os.path.join(self.prefix_path, name)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # readers never see half a file

    def remove(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)

    def to_local_path(self, path: str) -> str:
        return path
