"""``shoal.run``: Horovod's programmatic launcher (``horovod.run``), on shoalrun's machinery."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shoal.config import LaunchConfig
from shoal.runner.function_job import FunctionJob
from shoal.runner.launcher import Job, build_slots


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    network_interfaces: Sequence[str] | None = None,
    executable: str | None = None,
    env: Mapping[str, str] | None = None,
    np: int | None = None,
    network_interface: str | None = None,
    output_filename: str | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on every rank of a new job and return the results in rank order.

    Horovod's ``horovod.run``: the same machinery as ``shoalrun`` (local processes, ssh to ``hosts``), the job's
    authenticated store carries the pickled function (cloudpickle when installed) and the results. ``func`` calls
    ``hvd.init()`` itself, as under Horovod. Must be called from the main thread (it handles SIGINT/SIGTERM).

    Args:
        func: the function; module-level, or anything cloudpickle can carry.
        args: positional arguments, the same on every rank.
        kwargs: keyword arguments, the same on every rank.
        num_proc: number of ranks (``np`` is Horovod's deprecated name).
        hosts: ``"host1:2,host2:2"``, as ``-H``.
        hostfile: a hostfile, as ``--hostfile``.
        start_timeout: seconds allowed for rendezvous.
        ssh_port: ssh port of remote hosts.
        ssh_identity_file: ssh private key.
        verbose: print what the launcher does.
        use_gloo: accepted for Horovod compatibility (Shoal always uses gloo, and NCCL for CUDA tensors).
        use_mpi: Shoal has no MPI controller; True is refused.
        network_interfaces: interfaces whose address remote workers use to reach the rendezvous.
        executable: the Python interpreter of the workers (default: this one).
        env: environment for the workers, on top of this process's.
        network_interface: Horovod's deprecated single-interface form.
        output_filename: directory for per-rank output logs, as ``--output-filename``.

    Returns:
        ``func``'s return value on each rank, in rank order.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), or the job failed.
        ValueError: bad arguments (no process count, both hosts and hostfile, ...).
        NotImplementedError: ``use_mpi=True``.
    """
    if use_mpi:
        raise NotImplementedError("shoal.run(use_mpi=True): Shoal has no MPI controller; it runs over gloo/NCCL")
    interfaces = list(network_interfaces or []) + ([network_interface] if network_interface else [])
    config = LaunchConfig(
        num_proc=num_proc if num_proc is not None else np,
        hosts=hosts,
        hostfile=hostfile,
        ssh_port=ssh_port,
        ssh_identity_file=ssh_identity_file,
        network_interface=",".join(interfaces) or None,
        output_filename=output_filename,
        verbose=bool(verbose),
        command=[executable or sys.executable, "-m", "shoal.runner.task"],
    )
    if start_timeout is not None:
        config.start_timeout = start_timeout
    try:
        config.check()
    except ValueError as error:
        raise ValueError(f"shoal.run: {error}") from None
    function = FunctionJob("shoal.run", func, args, kwargs)
    slots = build_slots(config)

    def collect(store: Any) -> None:
        function.take_ranks(function.view(store, job.secret), len(slots))

    def publish(store: Any) -> None:
        function.publish(store, job.secret)

    job = Job(config, slots, extra_env=dict(env or {}), on_store=publish, on_finish=collect)
    return function.in_rank_order(job.run(), len(slots))
