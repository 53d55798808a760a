"""Shoal on Ray: ``RayExecutor`` (``horovod.ray.RayExecutor``'s API: one actor per rank, ``run(fn)``),
``ElasticRayExecutor`` (workers come and go with Ray's nodes), and ``shoal.ray.train.ShoalConfig`` (a Ray Train
backend). Ray itself is optional: ``pip install 'shoal[ray]'``; importing this package does not import Ray."""

from shoal.ray.elastic import ElasticRayExecutor
from shoal.ray.executor import RayExecutor, RaySettings

__all__ = ["ElasticRayExecutor", "RayExecutor", "RaySettings"]
