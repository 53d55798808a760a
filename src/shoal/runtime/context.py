"""The process-wide Shoal context: ``init()`` builds it, ``shutdown()`` tears it down.

Horovod's API is module-level (``hvd.rank()``), so one context per process is unavoidable. Everything that belongs
to one ``init()`` lives in it: the fields below, and in ``parts`` what higher layers build on it (the user API's
session with the engine, handles and name counters; the measured calibration; the last ``comm="auto"`` plan; the
parameter server's connection). ``shutdown()`` drops it whole, and an elastic re-form builds a new one, so nothing of
an old job survives into the next. What outlives a context on purpose: the job's store connection
(``comm.store``: a rank-0-hosted store must outlive re-inits), the launcher watchdog thread (one per process),
process-unique handle and session ids, and the rule that dedicated parameter servers serve one ``init()``.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.comm import process_group, store
from shoal.config import worker_setting
from shoal.config.worker import LAUNCHER_PID_ENV
from shoal.exceptions import HorovodInternalError, NotInitializedError
from shoal.log import get_logger
from shoal.runtime import elastic_rendezvous, heartbeat, preemption
from shoal.runtime.launch_env import LaunchInfo, detect_launch
from shoal.runtime.topology import Topology, build_topology
from shoal.runtime.watchdog import start_launcher_watchdog


@dataclass
class Context:
    """Everything ``init()`` established for this process."""

    launch: LaunchInfo
    topology: Topology
    backend: str
    generation: int
    store: Any
    """The job store scoped to this generation; later layers keep their own keys under it."""
    job_store: Any = None
    """The whole job's store (elastic training talks to shoalrun's driver through it)."""
    parts: dict[str, Any] = field(default_factory=dict)
    """What higher layers keep for this ``init()``, by a name their module owns (see the module docstring)."""

    def part(self, name: str) -> Any:
        """A higher layer's state for this ``init()``; None until it sets it."""
        return self.parts.get(name)

    def set_part(self, name: str, value: Any) -> None:
        self.parts[name] = value


_lock = threading.RLock()
_context: Context | None = None
_shutdown_hooks: list[Callable[[], bool | None]] = []
_init_hooks: list[Callable[[Context], None]] = []
_abandon_hooks: list[Callable[[Context, str], bool]] = []
_exit_hook_registered = False
_elastic_round = 0
"""The last elastic round this process joined (0: none yet)."""


def register_init_hook(hook: Callable[[Context], None]) -> None:
    """Run ``hook(context)`` at the end of every ``init()`` (the engine starts itself this way)."""
    _init_hooks.append(hook)


def register_abandon_hook(hook: Callable[[Context, str], bool]) -> None:
    """Run ``hook(context, message)`` when that context's job can no longer complete a collective (an elastic round
    lost a member): it fails what is outstanding, so the caller restores and re-forms instead of waiting. It returns
    False when it has nothing to act on yet (its part of the context is not built): it is asked again later."""
    _abandon_hooks.append(hook)


def _round_broken(round_number: int, failed: str) -> bool:
    """The heartbeat's report that the driver marked elastic round ``round_number`` broken; False while this worker
    is still joining that round (the report is then made again at the next beat)."""
    ctx = _context
    if ctx is None:
        return False  # joining that round (or leaving it): asked again at the next beat
    if ctx.generation != round_number:
        return True  # this worker has left that round already
    message = (
        f"elastic round {round_number} lost worker {failed}: its collectives cannot complete, so the pending "
        "requests fail and the job re-forms"
    )
    handled = [hook(ctx, message) for hook in list(_abandon_hooks)]
    return all(handled)


def register_shutdown_hook(hook: Callable[[], bool | None]) -> None:
    """Run ``hook()`` at the start of every ``shutdown()``, before the process group is destroyed.

    A hook returns False when a thread of its own may still be using the process group (it did not stop in
    time): the group is then left to the process's exit rather than destroyed under that thread.
    """
    _shutdown_hooks.append(hook)


def init() -> Context:
    """Join the job described by the environment; a no-op when already initialized.

    Returns:
        The process context.

    Raises:
        RuntimeError: when rendezvous fails (unreachable store, wrong secret, timeout).
        ValueError: when the launcher environment is inconsistent.
    """
    global _context
    with _lock:
        if _context is not None:
            return _context
        launch = detect_launch(os.environ)
        timeout_s = worker_setting("start_timeout")
        job_store = store.connect_store(launch, timeout_s)
        if elastic_rendezvous.is_elastic_worker():
            preemption.install(launch, lambda: _elastic_round)
            heartbeat.start(launch, lambda: _elastic_round, _round_broken)
            launch, scoped_store, generation = _join_elastic_round(launch, job_store)
        else:
            if os.environ.get(LAUNCHER_PID_ENV):  # a static shoalrun job: shoalrun watches the heartbeat too
                heartbeat.start(launch, lambda: 0, lambda *_: True, heartbeat.static_worker_id(launch.rank))
            scoped_store, generation = store.generation_store(job_store, launch.secret, launch.rank)
        try:
            # An elastic round's members are all running once it formed: a connection that does not come within
            # ROUND_CONNECT_TIMEOUT_S is a member that died meanwhile, and the worker joins the next round.
            connect_s = elastic_rendezvous.round_connect_timeout()
            backend = process_group.init_world(scoped_store, launch.rank, launch.size, max(timeout_s, 300.0), connect_s)
            gathered = process_group.allgather_json([launch.host_key, launch.local_rank])
            # A launcher that gives no local rank (a PyTorchJob pod, an MPI without one) sends None: derived below.
            if not all(
                isinstance(g, list) and len(g) == 2 and isinstance(g[0], str) and (g[1] is None or type(g[1]) is int)
                for g in gathered
            ):
                raise RuntimeError(f"shoal: malformed topology exchange at init: {gathered!r}")
            topology = build_topology(launch.rank, [g[0] for g in gathered], [g[1] for g in gathered])
            _context = Context(
                launch=launch,
                topology=topology,
                backend=backend,
                generation=generation,
                store=scoped_store,
                job_store=job_store,
            )
            get_logger().debug(
                "rank %d/%d initialized by %s (generation %d, backend %s)",
                topology.rank,
                topology.size,
                launch.launcher,
                generation,
                backend,
            )
            for hook in _init_hooks:
                hook(_context)
        except Exception as error:
            _abandon_init()
            if elastic_rendezvous.is_elastic_worker():  # a peer of the new round died meanwhile: form another
                raise HorovodInternalError(f"joining elastic round {generation} failed: {error}") from error
            raise
        global _exit_hook_registered
        if not _exit_hook_registered:
            # As in Horovod: a script that never calls shutdown() still stops the engine thread cleanly at exit,
            # instead of dying inside a collective while the interpreter tears down.
            atexit.register(shutdown)
            _exit_hook_registered = True
        start_launcher_watchdog()
        return _context


def _abandon_init() -> None:
    """Undo a half-done init(): stop whatever the hooks started, leave the process group, forget the context."""
    global _context
    if _context is not None:
        for hook in _shutdown_hooks:
            try:
                hook()
            except Exception as error:  # cleaning up after a failure; the original error is what matters
                get_logger().debug("shutdown hook failed while abandoning init: %s", error)
    process_group.destroy_world()
    _context = None


def _join_elastic_round(launch: LaunchInfo, job_store: Any) -> tuple[LaunchInfo, Any, int]:
    """Take this worker's place in the driver's newest round; its rank and size come from there, not the env."""
    global _elastic_round
    keys = elastic_rendezvous.ElasticKeys(store.secret_namespace(launch.secret))
    # Longer than the driver waits for a round's members (--elastic-timeout + --start-timeout): only a driver that is
    # gone makes a worker give up.
    timeout_s = worker_setting("elastic_timeout") + worker_setting("start_timeout") + 30.0
    worker_id = os.environ[elastic_rendezvous.ELASTIC_ID_ENV]
    assignment, round_number = elastic_rendezvous.join_round(job_store, keys, worker_id, _elastic_round, timeout_s)
    _elastic_round = round_number
    launch = dataclasses.replace(
        launch, rank=assignment.rank, size=assignment.size, local_rank=assignment.local_rank, host_key=assignment.hostname
    )

    def broken() -> str | None:  # a member died while the round formed: the keys it was to write never come
        failed = elastic_rendezvous.failed_member(job_store, keys, round_number)
        return None if failed is None else f"elastic round {round_number} lost worker {failed}"

    scoped = store.prefix_store(keys.group_prefix(round_number), job_store, abort=broken)
    return launch, scoped, round_number


def shutdown() -> None:
    """Leave the job: stop the engine, destroy the process group. ``init()`` may be called again afterwards."""
    global _context
    with _lock:
        if _context is None:
            return
        safe = True
        try:
            for hook in _shutdown_hooks:
                safe = hook() is not False and safe
        finally:
            if safe:
                process_group.destroy_world()
            else:
                get_logger().error("a Shoal thread is still inside a collective; the process group is left open")
            _context = None


def current() -> Context:
    """Return the context, or raise the error Horovod users expect when ``init()`` was not called."""
    context = _context
    if context is None:
        raise NotInitializedError("Shoal has not been initialized; use shoal.torch.init() (hvd.init()).")
    return context


def peek() -> Context | None:
    """The context, or None outside ``init()``/``shutdown()`` (never raises)."""
    return _context


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _context is not None
