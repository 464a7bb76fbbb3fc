"""Spark ML stages: `SparknetEstimator` trains, `SparknetModel` predicts.

Either is a stage of a `Pipeline`; a model is also made from any finished run dir
(`SparknetModel.from_run`).
"""

from sparknet.ml.estimator import SparknetEstimator
from sparknet.ml.model import SparknetModel

__all__ = ["SparknetEstimator", "SparknetModel"]
