"""The launcher side: ``horovodrun`` (``horovod.runner.launch``), host parsing and placement,
worker processes. It never imports the training runtime."""
