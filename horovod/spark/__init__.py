"""``horovod.spark``: Horovod jobs on the Spark cluster a user already has (upstream's
``horovod.spark.run``; docs/spark.md).

Importing it imports no training framework and not PySpark: ``run`` needs an active Spark
session, the tasks import what the user's function imports.

Must not touch: the training runtime (see ``horovod.spark.runner``).
"""

from horovod.spark.elastic import run_elastic
from horovod.spark.runner import run

__all__ = ["run", "run_elastic"]
