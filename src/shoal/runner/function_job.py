"""A function run as a job, the driver's side: ``shoal.run``, ``shoal.spark.run`` and ``run_elastic``, and
``ElasticRayExecutor.run`` publish the pickled call in the job's store and collect each rank's (or elastic worker's)
result from it. The worker's side is ``shoal.runner.task``.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from shoal.runner.elastic_worker import WorkerState
from shoal.runner.task import PAYLOAD_KEY, elastic_result_key, result_key, task_prefix


def dumps(value: Any) -> bytes:
    """cloudpickle when installed (lambdas and closures travel by value, as in Horovod), else pickle."""
    try:
        import cloudpickle  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return pickle.dumps(value)
    return bytes(cloudpickle.dumps(value))


class FunctionJob:
    """``fn(*args, **kwargs)`` on every rank of a job: its payload, and the results taken so far.

    ``results`` maps a rank (static jobs) or an elastic worker's id to ``(status, value)``: status ``"ok"`` and the
    returned value, or ``"error"`` and the worker's traceback.
    """

    def __init__(self, what: str, fn: Callable[..., Any], args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> None:
        self.what = what
        """The caller's name in messages (``shoal.run``, ``ElasticRayExecutor.run``, ...)."""
        self.payload = dumps((fn, tuple(args or ()), dict(kwargs or {})))
        self.results: dict[Hashable, tuple[str, Any]] = {}

    @staticmethod
    def view(store: Any, secret: str) -> Any:
        """The job's function keys in ``store``."""
        return store.with_prefix(task_prefix(secret))

    def publish(self, store: Any, secret: str) -> Any:
        """Put the payload where the workers fetch it; returns the job's view of the store."""
        view = self.view(store, secret)
        view.set(PAYLOAD_KEY, self.payload)
        return view

    def take(self, view: Any, keys: Mapping[Hashable, str]) -> list[Hashable]:
        """Fetch (once each) the results that arrived under ``keys`` (id -> store key); returns the new ids."""
        new = []
        for ident, key in keys.items():
            if ident not in self.results and view.check([key]):
                self.results[ident] = pickle.loads(view.get(key))
                new.append(ident)
        return new

    def take_ranks(self, view: Any, count: int) -> list[Hashable]:
        return self.take(view, {rank: result_key(rank) for rank in range(count)})

    def take_workers(self, view: Any, worker_ids: Iterable[str]) -> list[Hashable]:
        return self.take(view, {worker_id: elastic_result_key(worker_id) for worker_id in worker_ids})

    def failures(self) -> list[str]:
        """One message per elastic worker that raised, in the order their results arrived."""
        return [f"worker {ident} raised:\n{value}" for ident, (status, value) in self.results.items() if status != "ok"]

    def in_rank_order(self, code: int, count: int) -> list[Any]:
        """A static job's outcome: every rank's value, in rank order.

        Raises:
            RuntimeError: a rank raised (the tracebacks), or the job failed without every result.
        """
        raised = [rank for rank in range(count) if self.results.get(rank, ("ok",))[0] != "ok"]
        failures = [f"rank {rank} raised:\n{self.results[rank][1]}" for rank in raised]
        if failures:
            raise RuntimeError(f"{self.what}: " + "\n".join(failures))
        if code != 0 or len(self.results) != count:
            missing = sorted(set(range(count)) - set(self.results))
            raise RuntimeError(f"{self.what}: the job failed (exit code {code}); ranks without a result: {missing}")
        return [self.results[rank][1] for rank in range(count)]

    def of_finished(self, code: int, workers: Iterable[Any], detail: str = "") -> list[Any]:
        """An elastic job's outcome: the values of the workers that finished, in rank order. A worker that raised
        but was recovered from, in a job that finished, is printed.

        Raises:
            RuntimeError: the job failed (the workers' tracebacks, then ``detail``).
        """
        failures = self.failures()
        finished = sorted((w for w in workers if w.state is WorkerState.FINISHED), key=lambda w: w.rank or 0)
        if code != 0 or not finished:
            reason = "\n".join(failures) or "see its messages above"
            raise RuntimeError(f"{self.what}: the elastic job failed (exit code {code}): {reason}{detail}")
        if failures:
            print(f"{self.what}: recovered from:\n" + "\n".join(failures), file=sys.stderr, flush=True)
        return [self.results[w.worker_id][1] for w in finished if w.worker_id in self.results]
