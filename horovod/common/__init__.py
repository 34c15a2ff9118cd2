"""Bottom layer shared by every part of pyhorovod: configuration, errors, logging, dtypes."""
