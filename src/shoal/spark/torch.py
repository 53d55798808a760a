"""``horovod.spark.torch``'s names: ``from shoal.spark.torch import TorchEstimator, TorchModel``."""

from __future__ import annotations

from shoal.spark.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
