"""pyhorovod: Horovod's distributed training API and launcher, in pure Python.

Framework packages: ``horovod.numpy`` (framework-free reference API) and, as they land,
``horovod.torch``, ``horovod.tensorflow``, ``horovod.keras``. The launcher is ``horovodrun``.
"""

__version__ = "0.1.0"
