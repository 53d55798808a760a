"""``shoal.ray.RayExecutor``: a Shoal job whose workers are Ray actors, with ``horovod.ray.RayExecutor``'s API."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.ray.job import RayJobStore, import_ray, rank_order
from shoal.ray.placement import PLACEMENT_STRATEGIES, Placement

SHUTDOWN_GRACE_S = 5.0
"""How long ``shutdown()`` lets the ranks shut Shoal down together before their actors are killed."""


@dataclass
class RaySettings:
    """Horovod's ``MiniSettings``: what the executor needs beyond the worker counts."""

    timeout_s: float = 30.0
    """How long workers wait for each other at rendezvous (as the ``START_TIMEOUT`` knob, docs/knobs.md)."""
    placement_group_timeout_s: float = 100.0
    """How long ``start()`` waits for Ray to reserve the workers' resources."""
    ssh_identity_file: str | None = None
    """Accepted for Horovod compatibility; Shoal on Ray needs no ssh."""
    ssh_str: str | None = None
    """Accepted for Horovod compatibility; Shoal on Ray needs no ssh."""
    nics: set[str] | None = None
    """Accepted for Horovod compatibility; gloo picks the interface that reaches the peers."""
    verbose: int = 1


class ShoalWorker:
    """The actor behind each rank: its environment is the job's before anything runs, so ``hvd.init()`` inside a
    function joins the job. Ray prefixes the actor's output lines with its ``repr``: ``(rank 0 pid=..)``."""

    def __init__(self, rank: int, env: Mapping[str, str]) -> None:
        os.environ.update(env)
        self.rank = rank
        self.executable: Any = None

    def __repr__(self) -> str:
        return f"rank {self.rank}"

    def where(self) -> tuple[str, int]:
        """This actor's host name and process id."""
        return socket.gethostname(), os.getpid()

    def start_executable(self, cls: type, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Create the object that ``execute`` passes to its functions."""
        self.executable = cls(*args, **kwargs)

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)``: the executable object, or None when ``start`` was given no class."""
        return fn(self.executable)

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``fn(*args, **kwargs)``."""
        return fn(*args, **kwargs)

    def leave(self) -> None:
        """Shut Shoal down in this process if the function left it running (before the actor is ended)."""
        import shoal.torch as hvd

        if hvd.is_initialized():
            hvd.shutdown()


class RayExecutor:
    """A Shoal job on a Ray cluster: ``start()`` places one actor per rank, ``run(fn)`` calls ``fn`` on every rank
    and returns the results in rank order, ``shutdown()`` ends the actors. As ``horovod.ray.RayExecutor``.

    The driver (this process) hosts the job's authenticated rendezvous store; each actor gets the variables
    shoalrun would give its worker (rank, local rank, cross rank by the Ray node it landed on). ``fn`` calls
    ``hvd.init()`` itself. If a rank raises or its actor dies, ``run`` ends every actor and raises with that
    rank's traceback; ``start()`` again for a new job.
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: float = 100,
        nics: set[str] | None = None,
    ) -> RaySettings:
        """Horovod's settings object; only ``timeout_s`` and ``placement_group_timeout_s`` matter to Shoal."""
        return RaySettings(
            timeout_s=timeout_s,
            placement_group_timeout_s=placement_group_timeout_s,
            ssh_identity_file=ssh_identity_file,
            ssh_str=ssh_str,
            nics=nics,
        )

    def __init__(
        self,
        settings: RaySettings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: Sequence[int] | None = None,
        elastic_timeout: float = 600,
        override_discovery: bool = True,
        placement_strategy: str = "PACK",
    ) -> None:
        """Args:
        settings: from ``create_settings`` (default: its defaults).
        num_workers: number of ranks.
        num_hosts: instead of ``num_workers``: this many nodes, ``num_workers_per_host`` ranks on each.
        num_workers_per_host: with ``num_hosts``.
        cpus_per_worker: Ray CPUs reserved per rank (and its OMP_NUM_THREADS, as Ray sets it).
        use_gpu: reserve GPUs (``gpus_per_worker`` each, default 1); the ranks then use NCCL for CUDA tensors.
        gpus_per_worker: GPUs per rank; needs ``use_gpu``.
        use_current_placement_group: inside a placement group (a Ray Tune trial), place the ranks in it.
        min_workers, max_workers, reset_limit, elastic_timeout: Horovod's elastic arguments: with ``min_workers``
            the job is elastic (``shoal.ray.ElasticRayExecutor``: ``run`` trains through workers and nodes that
            come and go; ``execute`` and ``run_remote`` are not available). ``cooldown_range`` and
            ``override_discovery`` are accepted and unused.
        placement_strategy: how the ranks' bundles spread over nodes: PACK (default), SPREAD, STRICT_PACK,
            STRICT_SPREAD (Ray's placement-group strategies).

        Raises:
            ValueError: neither or both of ``num_workers`` and ``num_hosts``, GPUs without ``use_gpu``, a bad count.
        """
        self._elastic: Any = None
        self.workers: list[Any] = []
        """The actors, in rank order."""
        if max_workers is not None and not min_workers:
            raise ValueError("RayExecutor: max_workers needs a positive min_workers (an elastic job)")
        if min_workers is not None:
            if num_workers or num_hosts:
                raise ValueError("RayExecutor: give min_workers (elastic) or num_workers/num_hosts, not both")
            from shoal.ray.elastic import ElasticRayExecutor

            self.settings = settings or RaySettings()
            self._elastic = ElasticRayExecutor(
                use_gpu=use_gpu,
                cpus_per_slot=cpus_per_worker,
                gpus_per_slot=gpus_per_worker,
                min_workers=min_workers,
                max_workers=max_workers,
                reset_limit=reset_limit,
                elastic_timeout=elastic_timeout,
                timeout_s=self.settings.timeout_s,
            )
            return
        if bool(num_workers) == bool(num_hosts):
            raise ValueError("RayExecutor: give exactly one of num_workers and num_hosts (with num_workers_per_host)")
        if gpus_per_worker and not use_gpu:
            raise ValueError("RayExecutor: gpus_per_worker is set but use_gpu is False")
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"RayExecutor: placement_strategy must be one of {PLACEMENT_STRATEGIES}")
        if num_hosts is not None and num_workers_per_host < 1:
            raise ValueError("RayExecutor: num_workers_per_host must be >= 1")
        self.settings = settings or RaySettings()
        self.num_workers = num_workers or (num_hosts or 0) * num_workers_per_host
        self.placement = Placement(
            self.num_workers,
            num_hosts,
            num_workers_per_host,
            cpus_per_worker,
            (gpus_per_worker or 1) if use_gpu else 0,
            use_current_placement_group,
            placement_strategy,
            self.settings.placement_group_timeout_s,
        )
        self.locations: list[tuple[str, int]] = []
        """Each rank's (host name, pid)."""
        self._store: RayJobStore | None = None

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[Any] | None = None,
        executable_kwargs: Mapping[str, Any] | None = None,
        extra_env_vars: Mapping[str, str] | None = None,
    ) -> None:
        """Place the actors, host the rendezvous store, give each actor its rank's environment, and create
        ``executable_cls(*executable_args, **executable_kwargs)`` in each when given (``execute`` passes it).

        Raises:
            RuntimeError: Ray cannot reserve the resources in time, or an actor fails to start.
        """
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._elastic is not None:
            self._elastic.start()
            return
        if self.workers:
            raise RuntimeError("RayExecutor.start(): already started; shutdown() first")
        if not ray.is_initialized():
            ray.init()
        bundle_of = self.placement.reserve(ray)
        nodes = self.placement.nodes(ray, bundle_of)
        order = rank_order(nodes)
        self._store = RayJobStore(ray.util.get_node_ip_address(), self.settings.timeout_s)
        envs = self._store.rank_envs([nodes[index] for index in order], extra_env_vars)
        actor_class = ray.remote(ShoalWorker)
        for rank, index in enumerate(order):
            strategy = PlacementGroupSchedulingStrategy(self.placement.group, placement_group_bundle_index=bundle_of[index])
            options = {"num_cpus": self.placement.cpus, "num_gpus": self.placement.gpus, "scheduling_strategy": strategy}
            self.workers.append(actor_class.options(**options).remote(rank, envs[rank]))
        try:
            self.locations = ray.get([worker.where.remote() for worker in self.workers])
            if executable_cls is not None:
                refs = [
                    w.start_executable.remote(executable_cls, executable_args or (), executable_kwargs or {})
                    for w in self.workers
                ]
                self._gather(refs, "start")
        except ray.exceptions.RayError as error:
            self._end(graceful=False)
            raise RuntimeError(f"RayExecutor.start(): a worker failed to start: {error}") from error

    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        """Every rank's result; on the first failure, end every actor and raise with that rank's error."""
        ray = import_ray()
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as error:
                rank = refs.index(done[0])
                where = f" on {self.locations[rank][0]} (pid {self.locations[rank][1]})" if rank < len(self.locations) else ""
                self._end(graceful=False)
                died = isinstance(error, ray.exceptions.RayActorError)
                raise RuntimeError(
                    f"RayExecutor.{what}: rank {rank}{where} {'died' if died else 'raised'}; every worker was ended:\n{error}"
                ) from error
        return list(ray.get(refs))

    def _started(self, what: str) -> None:
        if self._elastic is not None:
            raise ValueError(f"RayExecutor.{what}: not available for an elastic job (min_workers); use run()")
        if not self.workers:
            raise RuntimeError(f"RayExecutor.{what}: not started (call start() first)")

    def run_remote(
        self, fn: Callable[..., Any], args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None
    ) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every rank; returns the ObjectRefs in rank order (``ray.get`` them)."""
        self._started("run_remote()")
        return [worker.run.remote(fn, tuple(args or ()), dict(kwargs or {})) for worker in self.workers]

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        callbacks: Sequence[Callable[..., Any]] | None = None,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order.

        Raises:
            RuntimeError: a rank raised or its actor died (every actor is then ended; the message holds the
                rank's traceback).
            ValueError: ``callbacks`` (Horovod's rank-0 logging callbacks are not supported; return values instead).
        """
        if callbacks:
            raise ValueError("RayExecutor.run(callbacks=...): not supported by Shoal; return values from fn instead")
        if self._elastic is not None:
            return list(self._elastic.run(fn, args, kwargs))
        return self._gather(self.run_remote(fn, args, kwargs), "run()")

    def execute(self, fn: Callable[[Any], Any], callbacks: Sequence[Callable[..., Any]] | None = None) -> list[Any]:
        """``fn(executable)`` on every rank (the object ``start`` created, or None); the results in rank order."""
        if callbacks:
            raise ValueError("RayExecutor.execute(callbacks=...): not supported by Shoal; return values from fn instead")
        self._started("execute()")
        return self._gather([worker.execute.remote(fn) for worker in self.workers], "execute()")

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        self._started("execute_single()")
        return self._gather([self.workers[0].execute.remote(fn)], "execute_single()")[0]

    def shutdown(self) -> None:
        """End every actor, release the placement group (when this executor made it) and stop the store."""
        self._end(graceful=True)

    def _end(self, graceful: bool) -> None:
        """``shutdown()``; ``graceful=False`` after a failure, when the other ranks sit in a collective that will
        not complete and a farewell queued behind it would only cost its grace period."""
        if self._elastic is not None:
            return
        ray = import_ray()
        if self.workers and graceful:  # let live ranks leave the job together (quietly) before their actors end
            farewells = [worker.leave.remote() for worker in self.workers]
            ray.wait(farewells, num_returns=len(farewells), timeout=SHUTDOWN_GRACE_S)
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except ray.exceptions.RayError:  # already gone
                pass
        self.workers, self.locations = [], []
        self.placement.release()
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> RayExecutor:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
