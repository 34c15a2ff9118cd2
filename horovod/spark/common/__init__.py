"""What the Spark estimators share (upstream's ``horovod.spark.common``): the ``Store`` of a
run's data, checkpoints and logs, and the ``SparkBackend`` that runs the training function.

Must not touch: the training runtime.
"""
