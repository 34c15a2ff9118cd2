"""pyhorovod: Horovod's distributed training API and launcher, in pure Python.

Framework packages: ``horovod.numpy`` (framework-free reference API) and, as they land,
``horovod.torch``, ``horovod.tensorflow``, ``horovod.keras``. The launcher is ``horovodrun``.

Must not touch: the runtime (nothing starts until a framework package's ``init()``).
"""

__version__ = "0.1.0"

from horovod.runner.run_func import run  # noqa: E402  (upstream's horovod.run)

__all__ = ["__version__", "run"]
