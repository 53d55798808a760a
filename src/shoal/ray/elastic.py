"""Elastic Shoal jobs on Ray: Shoal's elastic driver (the one behind ``shoalrun --min-np``) with Ray's nodes as
its host discovery and Ray actors as its way of starting workers.

Each worker is a process started by a small actor pinned to its node; the driver (this process) hosts the job's
authenticated store, forms rounds of membership, and re-forms the job when a worker exits non-zero (its actor or
node gone) or when Ray's nodes change: a node that joins gets workers, which join at the survivors' next
``state.commit()``; a node that leaves takes its workers with it, and the survivors roll back to their last commit.
The training function is the same as under ``shoalrun --min-np``: ``hvd.init()``, an ``hvd.elastic.*State`` and a
function decorated with ``@hvd.elastic.run``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from shoal.config import LaunchConfig
from shoal.runner.discovery import HostDiscovery
from shoal.runner.elastic_driver import ElasticSupervisor
from shoal.runner.function_job import FunctionJob
from shoal.runner.hosts import HostSlots
from shoal.runner.spawners import PolledProcess, Spawner, Worker, WorkerSpec
from shoal.runner.worker_env import child_env, start_worker
from shoal.runtime.elastic_rendezvous import ELASTIC_ID_ENV

NODE_POLL_S = 1.0
"""How often the driver asks Ray for its nodes."""


class RayNodes:
    """Ray's live nodes as hosts (``ray-<node id prefix>``), each offering as many slots as its total CPUs (and GPUs)
    hold workers of ``cpus_per_worker`` (and ``gpus_per_worker``).

    A node Ray is draining (``ray drain-node``: preemption, idle termination) is no longer offered, so its workers
    leave at the next commit with nothing rolled back, as a preemption notice makes them leave under shoalrun.
    """

    def __init__(self, ray: Any, cpus_per_worker: float, gpus_per_worker: float) -> None:
        self._ray = ray
        self._cpus = cpus_per_worker
        self._gpus = gpus_per_worker
        self.node_ids: dict[str, str] = {}
        """Host name -> Ray node id, for every node ever seen."""

    def _draining(self) -> set[str]:
        """Ids of the nodes Ray is draining (empty where this Ray cannot say)."""
        try:
            from ray._private.state import state

            return set(state.get_draining_nodes())
        except Exception:  # an older Ray, or one whose private state API moved: no draining seen
            return set()

    def __call__(self) -> list[HostSlots]:
        """Ray's live nodes now, as hosts (the elastic job's ``HostDiscovery`` source)."""
        hosts = []
        draining = self._draining()
        for node in self._ray.nodes():
            if not node.get("Alive") or str(node.get("NodeID")) in draining:
                continue
            resources = node.get("Resources", {})
            slots = int(resources.get("CPU", 0) // self._cpus) if self._cpus > 0 else 1 << 20
            if self._gpus > 0:
                slots = min(slots, int(resources.get("GPU", 0) // self._gpus))
            if slots < 1:
                continue
            name = "ray-" + str(node["NodeID"])[:12]
            self.node_ids[name] = str(node["NodeID"])
            hosts.append(HostSlots(name, slots))
        return hosts


class WorkerProcessActor:
    """Starts one elastic worker process on its node and waits for it; ``signal`` reaches its process group."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return self.label  # Ray's prefix for the worker's output lines

    def start(self, module_args: Sequence[str], env: Mapping[str, str]) -> int:
        """Run ``python -m ...`` with this node's interpreter and the job's environment; its exit code."""
        # (env carries OMP_NUM_THREADS, set by the driver from the actor's CPUs: child_env's default never applies)
        self.process = start_worker([sys.executable, *module_args], child_env(env, 1), stream=False)
        return self.process.wait()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass


class RayProcess(PolledProcess):
    """What the elastic driver needs of a ``Popen``, for a worker started by a ``WorkerProcessActor``."""

    def __init__(self, ray: Any, done: Any) -> None:
        self._ray = ray
        self._done = done
        self.stdin = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The worker's exit code once it ended; -9 when its actor (or node) died."""
        if self.returncode is None and self._ray.wait([self._done], timeout=0)[0]:
            try:
                self.returncode = int(self._ray.get(self._done))
            except self._ray.exceptions.RayError:
                self.returncode = -int(signal.SIGKILL)
        return self.returncode


@dataclass
class RayWorker(Worker):
    """A worker whose process lives on a Ray node: signals go through its actor, SIGKILL ends the actor."""

    actor: Any = None
    ray: Any = None

    def signal_tree(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self.ray.kill(self.actor, no_restart=True)  # the worker dies with it (PR_SET_PDEATHSIG)
        else:
            self.actor.signal.remote(int(sig))


class RayActorSpawner(Spawner):
    """Starts each worker of an elastic job in an actor on its Ray node (``RayNodes`` names the nodes)."""

    def __init__(self, ray: Any, nodes: RayNodes, cpus_per_worker: float, gpus_per_worker: float) -> None:
        self._ray = ray
        self._nodes = nodes
        self._cpus = cpus_per_worker
        self._gpus = gpus_per_worker
        self._actor_class = ray.remote(WorkerProcessActor)
        self._actors: list[Any] = []

    def remote(self, hostname: str) -> bool:
        return True  # an actor's worker may be on any node: it reaches the store over the network

    def spawn(self, spec: WorkerSpec) -> Worker:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        env = dict(spec.env)
        env.setdefault("OMP_NUM_THREADS", str(max(1, int(self._cpus))))
        label = f"worker {env.get(ELASTIC_ID_ENV, spec.slot.rank)}"
        actor = self._actor_class.options(
            num_cpus=self._cpus,
            num_gpus=self._gpus,
            max_concurrency=2,  # signal() while start() waits
            scheduling_strategy=NodeAffinitySchedulingStrategy(self._nodes.node_ids[spec.slot.hostname], soft=False),
        ).remote(label)
        self._actors.append(actor)
        done = actor.start.remote(["-m", "shoal.runner.task"], env)
        self.job.verbose(f"{label} on node {spec.slot.hostname}")
        return RayWorker(slot=spec.slot, process=cast(Any, RayProcess(self._ray, done)), actor=actor, ray=self._ray)

    def close(self) -> None:
        """Kill every actor this spawner started (their workers die with them)."""
        for actor in self._actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except self._ray.exceptions.RayError:
                pass
        self._actors.clear()


class ElasticRayExecutor:
    """An elastic Shoal job on Ray, with Horovod's ``ElasticRayExecutor`` shape: ``start()``, then ``run(fn)``
    trains to the end through workers and nodes that come and go and returns the last round's results in rank order.

    ``fn`` runs in a worker process on a Ray node (pickled with cloudpickle, as Ray does): it calls ``hvd.init()``,
    builds an ``hvd.elastic.TorchState`` and calls a function decorated with ``@hvd.elastic.run``, as under
    ``shoalrun --min-np``. Called from the main thread, ``run`` ends the job on SIGINT/SIGTERM; from another thread
    those signals stay the caller's.
    """

    @classmethod
    def create_settings(
        cls,
        min_np: int = 1,
        max_np: int | None = None,
        reset_limit: int | None = None,
        elastic_timeout: float = 600,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        nics: set[str] | None = None,
        **unused: Any,
    ) -> dict[str, Any]:
        """Horovod's ``ElasticRayExecutor.create_settings``; ssh and NIC settings are accepted and unused."""
        return {
            "min_workers": min_np,
            "max_workers": max_np,
            "reset_limit": reset_limit,
            "elastic_timeout": elastic_timeout,
            "timeout_s": timeout_s,
        }

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float | None = None,
        env_vars: Mapping[str, str] | None = None,
        override_discovery: bool = True,
        *,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        elastic_timeout: float | None = None,
        timeout_s: float | None = None,
        verbose: bool = False,
    ) -> None:
        """Args:
        settings: from ``create_settings`` (or give its fields as keywords: ``min_workers``, ``max_workers``,
            ``reset_limit``, ``elastic_timeout``, ``timeout_s``).
        use_gpu: reserve ``gpus_per_slot`` GPUs (default 1) per worker.
        cpus_per_slot: CPUs per worker; a node offers ``its CPUs // cpus_per_slot`` slots.
        env_vars: more environment for every worker.
        override_discovery: accepted for Horovod compatibility (discovery is always Ray's nodes).
        verbose: print what the driver does.

        Raises:
            ValueError: ``max_workers`` below ``min_workers``, a count below 1.
        """
        given = dict(settings or {})
        for name, value in (
            ("min_workers", min_workers),
            ("max_workers", max_workers),
            ("reset_limit", reset_limit),
            ("elastic_timeout", elastic_timeout),
            ("timeout_s", timeout_s),
        ):
            if value is not None:
                given[name] = value
        self.min_workers = int(given.get("min_workers") or 1)
        self.max_workers = given.get("max_workers")
        if self.min_workers < 1 or (self.max_workers is not None and self.max_workers < self.min_workers):
            raise ValueError(
                f"ElasticRayExecutor: need 1 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}"
            )
        self.reset_limit = given.get("reset_limit")
        self.elastic_timeout = float(given.get("elastic_timeout") or 600)
        self.timeout_s = float(given.get("timeout_s") or 30)
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = (gpus_per_slot or 1) if use_gpu else 0
        self.env_vars = dict(env_vars or {})
        self.verbose = verbose
        self._ray: Any = None

    def start(self) -> None:
        """Connect to Ray (``ray.init()`` when not yet connected)."""
        from shoal.ray.job import import_ray

        self._ray = import_ray()
        if not self._ray.is_initialized():
            self._ray.init()

    def _config(self) -> LaunchConfig:
        config = LaunchConfig(
            num_proc=self.min_workers,
            min_np=self.min_workers,
            max_np=self.max_workers,
            reset_limit=self.reset_limit,
            elastic_timeout=self.elastic_timeout,
            start_timeout=self.timeout_s,
            verbose=bool(self.verbose),
            command=["python", "-m", "shoal.runner.task"],
        )
        config.check()
        return config

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        callbacks: Sequence[Callable[..., Any]] | None = None,
    ) -> list[Any]:
        """Train ``fn(*args, **kwargs)`` elastically; the results of the workers that finished, in rank order.

        Raises:
            RuntimeError: the job failed (fewer than ``min_workers`` for ``elastic_timeout``, the reset limit, every
                worker raising: the tracebacks are in the message). A worker that raised but was recovered from,
                in a job that finished, is printed instead.
        """
        if callbacks:
            raise ValueError("ElasticRayExecutor.run(callbacks=...): not supported by Shoal; return values instead")
        if self._ray is None:
            self.start()
        ray = self._ray
        function = FunctionJob("ElasticRayExecutor.run", fn, args, kwargs)
        nodes = RayNodes(ray, self.cpus_per_slot, self.gpus_per_slot)

        def publish(store: Any) -> None:
            function.publish(store, job.secret)

        def collect(store: Any) -> None:
            function.take_workers(function.view(store, job.secret), [worker.worker_id for worker in supervisor.elastic])

        supervisor = ElasticSupervisor(self._config(), [], discovery=HostDiscovery([], nodes, interval_s=NODE_POLL_S))
        job = supervisor.job_of(
            spawner=RayActorSpawner(ray, nodes, self.cpus_per_slot, self.gpus_per_slot),
            rendezvous_addr=ray.util.get_node_ip_address(),
            extra_env=self.env_vars,
            on_store=publish,
            on_finish=collect,
        )
        code = job.run()  # its spawner's actors end with it
        return function.of_finished(code, supervisor.elastic)

    def shutdown(self) -> None:
        """Nothing outlives ``run`` (its actors end with it); kept for Horovod's API."""
