"""sparknet: synchronized local SGD for PyTorch models on Apache Spark (SparkNet, DiLoCo)."""

__version__ = "0.1.0"
