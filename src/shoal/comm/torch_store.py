"""The job's authenticated store as a torch ``Store``, which gloo's rendezvous and torch's own code take.

A Python store handed to torch must stay referenced from Python for as long as torch uses it (pybind keeps only the
C++ half alive): clones and prefixed views are therefore kept by the view they came from, and
``shoal.comm.store.prefix_store`` asks for a prefixed view instead of wrapping in torch's PrefixStore.
"""

from __future__ import annotations

import torch.distributed as dist

from shoal.comm.auth_store import KeyValueView


class StoreView(KeyValueView, dist.Store):
    """``KeyValueView``'s methods over a local or remote backend, as torch's ``Store`` interface."""
