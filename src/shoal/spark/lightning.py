"""``horovod.spark.lightning``'s names: its ``TorchEstimator`` (for a LightningModule) is Shoal's
``LightningEstimator``; ``TorchModel`` is the same model class as the torch estimator's."""

from __future__ import annotations

from shoal.spark.estimator import LightningEstimator, TorchModel

TorchEstimator = LightningEstimator

__all__ = ["TorchEstimator", "TorchModel"]
