"""Shoal on Spark: ``shoal.spark.run`` is Horovod's ``horovod.spark.run``.

``run(fn, ...)`` runs ``fn(*args, **kwargs)`` on ``num_proc`` ranks, each in a Spark task of one barrier stage, and
returns every rank's result in rank order. The driver hosts the job's authenticated store (a fresh secret per job,
shipped to the tasks inside their closure, never on a command line); each task starts its rank's worker process
(``shoal.spark._task``), and ``fn`` calls ``hvd.init()`` itself, as under Horovod. Needs ``pip install
'shoal[spark]'`` (pyspark) and an active ``SparkContext``.
"""

from __future__ import annotations

import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # the driver imports it when run() is called
    from shoal.runner.function_job import FunctionJob

__all__ = ["LightningEstimator", "LocalStore", "Store", "TorchEstimator", "TorchModel", "run", "run_elastic"]

_LAZY = {
    "LightningEstimator": "estimator",
    "TorchEstimator": "estimator",
    "TorchModel": "estimator",
    "Store": "store",
    "LocalStore": "store",
    "run_elastic": "elastic",
}


def __getattr__(name: str) -> Any:
    """The estimator and store on first use (they import pyspark; ``run`` alone does not at import)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"shoal.spark.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'shoal.spark' has no attribute {name!r}")


_POLL_S = 0.1


def _spark_context() -> Any:
    try:
        from pyspark import SparkContext
    except ImportError:
        raise ImportError("shoal.spark needs pyspark: pip install 'shoal[spark]'") from None
    context = SparkContext._active_spark_context
    if context is None:
        raise RuntimeError("shoal.spark.run: could not find an active SparkContext; are you running in a PySpark session?")
    return context


def _start_timeout(start_timeout: float | None) -> float:
    from shoal.config import worker_setting

    return float(start_timeout) if start_timeout is not None else float(worker_setting("spark_start_timeout"))


def _driver_address(context: Any, nics: Sequence[str] | None) -> str:
    """Where the executors reach the driver: the first of ``nics``, else Spark's own ``spark.driver.host``."""
    from shoal.runner.rendezvous_address import interface_address

    if nics:
        return interface_address(sorted(nics)[0])
    host = context.getConf().get("spark.driver.host") or socket.gethostname()
    return socket.gethostbyname(host)


def _host_store(addr: str, secret: str, timeout_s: float) -> tuple[Any, int]:
    """The job's authenticated store, listening on ``addr`` at a free port; and that port."""
    from shoal.comm.store import host_store

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((addr, 0))
    listener.listen(128)
    port = int(listener.getsockname()[1])
    return host_store(addr, port, secret, timeout_s, listen_fd=listener.detach()), port


def _free_resources(context: Any) -> str:
    """What the cluster offers right now, for a start-up timeout's message."""
    try:
        executors = context._jsc.sc().statusTracker().getExecutorInfos()
        running = sum(info.numRunningTasks() for info in executors)
        return (
            f"the cluster has {len(executors)} executor(s) (the driver's included in local mode), "
            f"{context.defaultParallelism} task slot(s) in all, {running} task(s) running"
        )
    except Exception:  # a cluster manager that says nothing: the advice stands alone
        return f"the cluster offers {context.defaultParallelism} task slot(s) (spark.default.parallelism)"


class _Output:
    """Streams the ranks' output from the store to ``stdout``/``stderr``, as ``[rank]<stream>:line``."""

    def __init__(self, view: Any, num_proc: int, sinks: dict[str, IO[str]], timestamps: bool) -> None:
        self._view, self._sinks, self._timestamps = view, sinks, timestamps
        self._read = {(rank, stream): 0 for rank in range(num_proc) for stream in sinks}
        self._lock = threading.Lock()

    def watch(self, label: int) -> None:
        """Stream worker ``label``'s output too (elastic jobs start workers as they go)."""
        with self._lock:
            for stream in self._sinks:
                self._read.setdefault((label, stream), 0)

    def drain(self) -> None:
        with self._lock:  # the whole drain: two threads draining at once would print a chunk twice
            self._drain_locked()

    def _drain_locked(self) -> None:
        from shoal.spark._task import output_key

        for (rank, stream), done in list(self._read.items()):
            count_key = output_key(rank, stream)
            if not self._view.check([count_key]):
                continue
            available = self._view.add(count_key, 0)
            for sequence in range(done, available):
                text = self._view.get(output_key(rank, stream, sequence)).decode(errors="replace")
                sink = self._sinks[stream]
                for line in text.splitlines():
                    stamp = time.strftime("%a %b %d %H:%M:%S %Y ") if self._timestamps else ""
                    sink.write(f"{stamp}[{rank}]<{stream}>:{line}\n")
                sink.flush()
            self._read[(rank, stream)] = available


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    extra_mpi_args: str | None = None,
    env: Mapping[str, str | None] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    nics: Sequence[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    executable: str | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` ranks in Spark tasks; every rank's result, in rank order.

    Horovod's ``horovod.spark.run``. Ranks are ordered by executor host (a host's ranks are contiguous, so local
    ranks and shared memory work). A rank that raises, or a task that dies, ends the whole stage, and ``run``
    raises with that rank's host and traceback; no worker process outlives the job.

    Args:
        fn: the training function; it calls ``hvd.init()`` itself. Anything cloudpickle can carry.
        args: positional arguments, the same on every rank.
        kwargs: keyword arguments, the same on every rank.
        num_proc: ranks (one Spark task each); default ``spark.default.parallelism``.
        start_timeout: seconds for every task to start; default the ``SPARK_START_TIMEOUT`` setting (Shoal's
            or Horovod's prefix), else 600. Barrier stages need all their tasks at once: a cluster
            with fewer free slots fails here, with what it has free.
        extra_mpi_args: Horovod's MPI option; Shoal has no MPI controller (refused when given).
        env: environment of the workers, over the executor's (a None value removes that variable).
        stdout: where the ranks' stdout goes, each line as ``[rank]<stdout>:...``; None leaves it in the
            executors' logs (Horovod's behaviour).
        stderr: the same for stderr.
        verbose: 0 quiet; 1 (default) says how many processes run; 2 also what the driver does.
        nics: network interfaces of the driver; the first one's address is where the tasks reach it (default:
            ``spark.driver.host``).
        prefix_output_with_timestamp: prefix each streamed line with the time it arrived on the driver.
        use_mpi: Shoal has no MPI controller; True is refused.
        use_gloo: accepted (Shoal always uses gloo, and NCCL for CUDA tensors).
        executable: the workers' Python (default: the executors' own).

    Raises:
        RuntimeError: a rank raised (its host and traceback are in the message), a task died, the stage failed,
            no SparkContext is active, or the tasks did not all start within ``start_timeout``.
        NotImplementedError: ``use_mpi=True`` or ``extra_mpi_args``.
        ValueError: ``num_proc`` below 1.
    """
    from shoal.runner.function_job import FunctionJob
    from shoal.spark._task import TaskSettings

    if use_mpi or extra_mpi_args:
        raise NotImplementedError("shoal.spark.run: Shoal has no MPI controller (use_mpi, extra_mpi_args); it uses gloo")
    context = _spark_context()
    if num_proc is None:
        num_proc = int(context.defaultParallelism)
        if verbose >= 1:
            print(f"shoal.spark.run: {num_proc} processes (from spark.default.parallelism)", file=sys.stderr, flush=True)
    elif verbose >= 1:
        print(f"shoal.spark.run: {num_proc} processes", file=sys.stderr, flush=True)
    if num_proc < 1:
        raise ValueError(f"shoal.spark.run: num_proc must be >= 1, got {num_proc}")
    timeout_s = _start_timeout(start_timeout)
    secret = secrets.token_hex(16)
    addr = _driver_address(context, nics)
    store, port = _host_store(addr, secret, timeout_s)
    function = FunctionJob("shoal.spark.run", fn, args, kwargs)
    view = function.publish(store, secret)
    sinks = {name: sink for name, sink in (("stdout", stdout), ("stderr", stderr)) if sink is not None}
    settings = TaskSettings(addr, port, secret, timeout_s, dict(env or {}), stream_output=bool(sinks), executable=executable)
    group = f"shoal.spark.run.{secret[:12]}"
    outcome: dict[str, Any] = {}
    if verbose >= 2:
        print(f"shoal.spark.run: the store listens on {addr}:{port}", file=sys.stderr, flush=True)
    thread = threading.Thread(
        target=_stage, args=(context, group, num_proc, settings, outcome), name="shoal-spark-stage", daemon=True
    )
    started_at = time.monotonic()
    output = _Output(view, num_proc, sinks, prefix_output_with_timestamp)
    try:
        thread.start()
        failure = _supervise(view, num_proc, thread, outcome, started_at, timeout_s, output, context, function)
        if failure is not None:
            context.cancelJobGroup(group)
            thread.join(timeout=60)
            raise RuntimeError(failure)
        return [function.results[rank][1] for rank in range(num_proc)]
    finally:
        if thread.is_alive():
            context.cancelJobGroup(group)
            thread.join(timeout=60)
        output.drain()
        store.close()


def _stage(context: Any, group: str, num_proc: int, settings: Any, outcome: dict[str, Any]) -> None:
    """The barrier stage of one task per rank (in a thread: the driver watches the store meanwhile)."""
    from shoal.spark._task import run_rank

    context.setJobGroup(group, f"shoal.spark.run: {num_proc} ranks", interruptOnCancel=True)
    try:
        rdd = context.parallelize(range(num_proc), num_proc).barrier()
        outcome["ranks"] = rdd.mapPartitions(lambda partition: run_rank(settings, partition)).collect()
    except BaseException as error:
        outcome["error"] = error


def _supervise(
    view: Any,
    num_proc: int,
    thread: threading.Thread,
    outcome: dict[str, Any],
    started_at: float,
    timeout_s: float,
    output: _Output,
    context: Any,
    function: FunctionJob,
) -> str | None:
    """Wait for the stage, taking each rank's result into ``function.results`` (a ``FunctionJob``) as it arrives;
    the reason the job failed, or None when every rank returned a result."""
    while True:
        alive = thread.is_alive()  # before the scan: a stage that ends during it is scanned once more
        output.drain()
        errors = []
        for rank in function.take_ranks(view, num_proc):
            status, value = function.results[rank]
            if status != "ok":
                host = view.get(f"host/{rank}").decode() if view.check([f"host/{rank}"]) else "?"
                errors.append(f"rank {rank} on host {host} raised:\n{value}")
        if errors:
            return "shoal.spark.run: " + "\n".join(errors)
        if not alive:
            if len(function.results) == num_proc:
                return None
            error = outcome.get("error")
            missing = [rank for rank in range(num_proc) if rank not in function.results]
            detail = f": {_first_line(error)}" if error is not None else ""
            return f"shoal.spark.run: the Spark stage failed; ranks without a result: {missing}{detail}"
        started = view.add("started", 0) if view.check(["started"]) else 0
        if started < num_proc and time.monotonic() - started_at > timeout_s:
            return (
                f"shoal.spark.run: timed out after {timeout_s:.0f} s waiting for {num_proc} Spark tasks to start "
                f"({started} started); each rank runs in a Spark task of one barrier stage, so the cluster needs "
                f"{num_proc} free task slots at once, and {_free_resources(context)}. Add executors or cores, lower "
                "num_proc, or raise start_timeout if resources are allocated on demand."
            )
        time.sleep(_POLL_S)


def _first_line(error: BaseException) -> str:
    """The informative line of a Spark error (a Py4J error's message is the JVM's whole stack): the Python
    exception raised in a task when there is one (``ModuleNotFoundError: No module named 'shoal'`` on executors
    without Shoal), else the first line."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines()]
    for line in lines:
        if line.startswith("RuntimeError: shoal.spark.run:") or "Barrier" in line:
            return line
    python = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception): ", line) and "Py4J" not in line]
    if python:
        return python[-1]
    return lines[0] if lines else type(error).__name__
