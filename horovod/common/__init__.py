"""Bottom layer shared by every part of pyhorovod: configuration, errors, logging, dtypes.

Must not touch: any layer above it: nothing here imports the rest of horovod.
"""
