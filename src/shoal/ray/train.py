"""A Ray Train backend: ``DataParallelTrainer(train_loop, backend_config=ShoalConfig(), scaling_config=...)`` runs a
Shoal training loop (``hvd.init()`` inside it) with Ray Train's workers, reporting and checkpoints.
``ShoalTrainer(train_loop, shoal_config=ShoalConfig(), scaling_config=...)`` is the same with Shoal's backend
preset (as ``TorchTrainer`` is for torch's).

Ray Train hosts third-party backends through its ``BackendConfig``/``Backend`` pair (as its own ``TorchConfig``):
before the loop starts, ``on_start`` hosts Shoal's authenticated rendezvous store in Ray Train's controller and
gives every worker its rank's environment (rank = Ray Train's world rank, local ranks by node); ``on_shutdown``
shuts Shoal down in the workers and stops the store.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shoal.ray.job import RayJobStore, import_ray

ray = import_ray()
try:
    from ray.train.backend import Backend, BackendConfig
    from ray.train.v2._internal.constants import is_v2_enabled
except ImportError as error:  # pragma: no cover (Ray without its train extra)
    raise ImportError("shoal.ray.train needs Ray Train: pip install 'shoal[ray]'") from error

if is_v2_enabled():  # Ray Train v2 (the default since Ray 2.51): the trainer whose RunConfig is ray.train.RunConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
else:  # pragma: no cover (RAY_TRAIN_V2_ENABLED=0)
    from ray.train.data_parallel_trainer import DataParallelTrainer  # type: ignore[assignment]


def _node_address() -> str:
    return str(ray.util.get_node_ip_address())


def _set_env(env: Mapping[str, str]) -> None:
    os.environ.update(env)


def _shutdown_shoal() -> None:
    import shoal.torch as hvd

    if hvd.is_initialized():
        hvd.shutdown()


@dataclass
class ShoalConfig(BackendConfig):
    """Ray Train's configuration for a Shoal backend."""

    timeout_s: float = 60.0
    """How long the workers wait for each other at ``hvd.init()`` (as the ``START_TIMEOUT`` knob, docs/knobs.md)."""
    env: Mapping[str, str] | None = None
    """More environment for every worker (Shoal's knobs under their full names, e.g.
    ``{shoal.config.env_name("FUSION_THRESHOLD"): "..."}``; docs/knobs.md)."""

    @property
    def backend_cls(self) -> type[Backend]:
        return _ShoalBackend

    @property
    def framework(self) -> str:
        return "shoal"


class _ShoalBackend(Backend):
    """Hosts the store while the worker group lives."""

    def __init__(self) -> None:
        self._store: RayJobStore | None = None

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, ShoalConfig)
        nodes = worker_group.execute(_node_address)
        if self._store is not None:  # a restarted worker group: a new job, a new secret
            self._store.close()
        self._store = RayJobStore(_node_address(), backend_config.timeout_s)
        envs = self._store.rank_envs(list(nodes), backend_config.env)
        ray.get([worker_group.execute_single_async(index, _set_env, env) for index, env in enumerate(envs)])

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        try:
            worker_group.execute(_shutdown_shoal)
        finally:
            if self._store is not None:
                self._store.close()
                self._store = None


class ShoalTrainer(DataParallelTrainer):
    """Ray Train's ``DataParallelTrainer`` with Shoal's backend: each worker runs ``train_loop_per_worker`` (which
    calls ``hvd.init()``); ``scaling_config``, ``run_config``, ``datasets`` and the rest pass through."""

    def __init__(
        self,
        train_loop_per_worker: Any,
        *,
        train_loop_config: Any = None,
        shoal_config: ShoalConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=shoal_config or ShoalConfig(),
            **kwargs,
        )
