"""Elastic training (Horovod's ``hvd.elastic``): survive workers that die or join, from an in-memory commit.

Run under ``shoalrun`` with an elastic flag (``--min-np``, ``--max-np``, ``--host-discovery-script``,
``--reset-limit``); decorate the training function with ``run`` and keep its state in a ``TorchState``.
"""

from shoal.core.elastic import ObjectState, State, run
from shoal.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from shoal.torch.elastic.sampler import ElasticSampler
from shoal.torch.elastic.state import TorchState

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]
