"""Data-parallel PyTorch training on Spark with horovod.spark.run: the digits CNN, each rank a
Spark task of one barrier stage.

    python examples/spark_torch_digits.py                    # a local[2] Spark session
    spark-submit examples/spark_torch_digits.py --num-proc 8 # on your cluster

The training function is the same as examples/ray_torch_digits.py's (upstream Horovod's usual
one); horovod.spark.run runs it on num_proc tasks at once and returns what each rank returned.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ray_torch_digits import train  # noqa: E402  (the one training function, no Ray needed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.02, help="single-rank learning rate")
    ap.add_argument("--min-accuracy", type=float, default=0.9)
    args = ap.parse_args()

    from pyspark.sql import SparkSession

    import horovod.spark

    builder = SparkSession.builder.appName("horovod digits")
    if "spark.master" not in SparkSession.builder._options and not os.environ.get("MASTER"):
        builder = (
            builder.master(f"local[{args.num_proc}]")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    # Ship the module that defines the training function to the executors (Spark's way).
    spark.sparkContext.addPyFile(os.path.join(os.path.dirname(__file__), "ray_torch_digits.py"))
    try:
        results = horovod.spark.run(
            train, args=(args.epochs, args.batch_size, args.lr), num_proc=args.num_proc
        )
    finally:
        spark.stop()
    for r in results:
        print(f"rank {r['rank']} of {r['size']}: test accuracy {r['accuracy']:.3f}")
    same = len({round(r["checksum"], 6) for r in results}) == 1
    print(f"replicas identical: {same}")
    return 0 if same and results[0]["accuracy"] >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
