"""What a launcher needs to start dedicated parameter servers (``shoalrun --num-servers S``).

Contract (all values strings; every name below is written without Shoal's prefix, see docs/knobs.md):

* every **worker** gets, on top of its usual environment, ``NUM_SERVERS=S`` (``worker_env``);
* server i (0 <= i < S) runs ``[python, "-m", "shoal.ps.server"]`` with the launcher's rendezvous variables
  (``JobAddress``: ``RENDEZVOUS_ADDR``, ``RENDEZVOUS_PORT``, ``SECRET``, the same values the workers get) plus its
  ``ServerIdentity``: ``PS_ROLE=server``, ``PS_SERVER_INDEX=i``, ``NUM_SERVERS=S`` and ``PS_NUM_WORKERS=P``
  (``server_processes``); it must not get ``RANK`` (it is not a Horovod rank). Knobs such as ``START_TIMEOUT`` and
  ``LOG_LEVEL`` pass through as for workers.

A server waits (unbounded) for the P workers to reach their first ``comm="ps"`` optimizer, serves until every worker
said goodbye at ``hvd.shutdown()`` (or exit), and exits 0. When a worker vanishes it tells the other workers which
one, prints the reason on stderr and exits 1. On SIGTERM it exits 0 at once. So the launcher should start servers
with the workers, treat a non-zero server exit like a failed worker (end the job), and once every worker has
exited give servers a few seconds to leave on their own, then SIGTERM them (a job whose workers never used
``comm="ps"`` leaves its servers waiting).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from shoal.config import RENDEZVOUS_ENV_NAMES, ServerIdentity

SERVER_MODULE = "shoal.ps.server"


def server_processes(
    num_servers: int, num_workers: int, rendezvous_env: Mapping[str, str], python: str = sys.executable
) -> list[tuple[list[str], dict[str, str]]]:
    """The command line and the environment additions of each dedicated server, in server-index order.

    Args:
        num_servers: S (>= 1).
        num_workers: P, the number of Horovod ranks of the job.
        rendezvous_env: the job's rendezvous variables (``RENDEZVOUS_ADDR``, ``RENDEZVOUS_PORT`` and ``SECRET``, as
            ``JobAddress.to_env`` writes them) as given to the workers (other entries are copied too, e.g. knobs).
        python: the interpreter to run the servers with.

    Returns:
        One ``(argv, env_additions)`` per server; merge the additions into the launcher's base environment.
    """
    if num_servers < 1 or num_workers < 1:
        raise ValueError(f"need at least one server and one worker, got {num_servers} and {num_workers}")
    missing = [n for n in RENDEZVOUS_ENV_NAMES if n not in rendezvous_env]
    if missing:
        raise ValueError(f"dedicated parameter servers need the job's rendezvous variables; missing {missing}")
    processes = []
    for index in range(num_servers):
        env = dict(rendezvous_env)
        env.update(ServerIdentity(index, num_servers, num_workers).to_env())
        processes.append(([python, "-m", SERVER_MODULE], env))
    return processes
