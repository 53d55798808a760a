"""The job's authenticated store as a torch ``Store``, which gloo's rendezvous and torch's own code take.

A Python store handed to torch must stay referenced from Python for as long as torch uses it (pybind keeps only the
C++ half alive): clones and prefixed views are therefore kept by the view they came from, and
``shoal.comm.store.prefix_store`` asks for a prefixed view instead of wrapping in torch's PrefixStore.
"""

from __future__ import annotations

import torch.distributed as dist

from shoal.comm.auth_store import AuthStoreServer
from shoal.comm.store_client import KeyValueView
from shoal.comm.store_client import connect as connect_view


class StoreView(KeyValueView, dist.Store):
    """``KeyValueView``'s methods over a local or remote backend, as torch's ``Store`` interface."""


def local_store(server: AuthStoreServer, timeout_s: float = 300.0) -> StoreView:
    """A torch ``Store`` over ``server``'s data for the hosting process itself."""
    return server.local_view(timeout_s, StoreView)


def connect(host: str, port: int, secret: str, timeout_s: float = 300.0, prefix: str = "") -> StoreView:
    """A torch ``Store`` client of the ``AuthStoreServer`` at ``host:port``, authenticated with ``secret``.

    Raises:
        StoreAuthError: the server refused this process's secret, or did not prove it holds the job secret.
        torch.distributed.DistNetworkError: nothing answered within ``timeout_s``.
    """
    return connect_view(host, port, secret, timeout_s, prefix, StoreView)
