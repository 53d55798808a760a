"""The gradient exchanges behind ``DistributedOptimizer``: each step's state and work, kept off the user's optimizer,
in parts (see docs/architecture.md, "The gradient exchange's parts").

- ``GradientExchange`` (``gradients``): wait-free backprop (Poseidon); it orchestrates the parts:
  ``BackwardHooks`` (``hooks``), ``Buckets`` (``buckets``), ``SparseGradients`` (``sparse``), ``SharedAdoption``
  (``adoption``), the timeline's ``ComputeMarks`` (``marks``), and the ``LayerRouter`` and ``MicroBatchWeights`` it
  is given.
- ``AdasumExchange`` (``adasum``): Horovod's Adasum delta optimizer on the same hooks.

The optimizer mixins (``optimizer.py``) are Horovod's surface and delegate.
"""

from shoal.torch.exchange.adasum import AdasumExchange
from shoal.torch.exchange.gradients import GradientExchange

__all__ = ["AdasumExchange", "GradientExchange"]
