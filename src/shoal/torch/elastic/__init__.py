"""Elastic training (in progress): the pieces that do not need the elastic driver yet.

``ElasticSampler`` is complete; ``run``, ``TorchState`` and the shoalrun elastic driver are not built yet.
"""

from shoal.torch.elastic.sampler import ElasticSampler

__all__ = ["ElasticSampler"]
