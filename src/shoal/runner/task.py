"""The worker side of ``shoal.run``: fetch the function from the job's store, run it, store the result.

Started by ``shoal.run`` as ``python -m shoal.runner.task`` on every rank, through the same launcher as
``shoalrun``. The payload and the results travel through the job's authenticated store (pickled: only members of
the job can write there).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback

from shoal.comm.names import secret_namespace
from shoal.config import worker_setting
from shoal.config.worker import JobAddress, SlotInfo
from shoal.runtime.elastic_rendezvous import ELASTIC_ID_ENV

PAYLOAD_KEY = "payload"


def result_key(rank: int) -> str:
    """Where rank ``rank`` leaves its result."""
    return f"result/{rank}"


def elastic_result_key(worker_id: str) -> str:
    """Where elastic worker ``worker_id`` leaves its result (the driver knows its final rank)."""
    return f"result/elastic/{worker_id}"


def task_prefix(secret: str | None) -> str:
    """The store prefix of ``shoal.run``'s keys in a job with this secret."""
    return f"{secret_namespace(secret)}/task/"


def main() -> int:
    """Run the job's function on this rank; exit 0 when it returned, 1 when it raised."""
    address, slot = JobAddress.from_env(os.environ), SlotInfo.from_env(os.environ)
    if address is None or slot is None:
        print("shoal.runner.task: not started by shoal.run (no rendezvous address or rank)", file=sys.stderr)
        return 2
    from shoal.comm.store import connect_job_store

    store = connect_job_store(
        address.addr, address.port, address.secret, worker_setting("start_timeout"), prefix=task_prefix(address.secret)
    )
    rank = slot.rank
    elastic_id = os.environ.get(ELASTIC_ID_ENV)  # an elastic worker: its rank is known only to the driver
    try:
        func, args, kwargs = pickle.loads(store.get(PAYLOAD_KEY))
        outcome: tuple[str, object] = ("ok", func(*args, **kwargs))
    except SystemExit as leaving:
        if leaving.code in (0, None):  # an elastic worker the driver left out of the job: no result, no failure
            return 0
        outcome = ("error", traceback.format_exc())
    except BaseException:  # the caller of shoal.run gets the traceback
        outcome = ("error", traceback.format_exc())
    try:
        data = pickle.dumps(outcome)
    except Exception as error:  # an unpicklable return value
        data = pickle.dumps(("error", f"rank {rank}'s result cannot be pickled: {error!r}"))
        outcome = ("error", "")
    store.set(elastic_result_key(elastic_id) if elastic_id else result_key(rank), data)  # type: ignore[arg-type]  # torch stubs say str; bytes are stored as they are
    return 0 if outcome[0] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
