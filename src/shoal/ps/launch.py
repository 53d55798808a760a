"""What a launcher needs to start dedicated parameter servers (``shoalrun --num-servers S``).

Contract (all values strings):

* every **worker** gets, on top of its usual environment, ``SHOAL_NUM_SERVERS=S`` (``worker_env``);
* server i (0 <= i < S) runs ``[python, "-m", "shoal.ps.server"]`` with the launcher's rendezvous variables
  (``SHOAL_RENDEZVOUS_ADDR``, ``SHOAL_RENDEZVOUS_PORT``, ``SHOAL_SECRET``: the same values the workers get) plus
  ``SHOAL_PS_ROLE=server``, ``SHOAL_PS_SERVER_INDEX=i``, ``SHOAL_NUM_SERVERS=S`` and ``SHOAL_PS_NUM_WORKERS=P``
  (``server_processes``); it must not get ``SHOAL_RANK`` (it is not a Horovod rank). Knobs such as
  ``SHOAL_START_TIMEOUT`` and ``SHOAL_LOG_LEVEL`` pass through as for workers.

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

SERVER_MODULE = "shoal.ps.server"


def server_processes(
    num_servers: int, num_workers: int, rendezvous_env: Mapping[str, str], python: str = sys.executable
) -> list[tuple[list[str], dict[str, str]]]:
    """The command line and the environment additions of each dedicated server, in server-index order.

    Args:
        num_servers: S (>= 1).
        num_workers: P, the number of Horovod ranks of the job.
        rendezvous_env: ``SHOAL_RENDEZVOUS_ADDR``, ``SHOAL_RENDEZVOUS_PORT`` and ``SHOAL_SECRET`` as given to the
            workers (other entries are copied too, e.g. knobs).
        python: the interpreter to run the servers with.

    Returns:
        One ``(argv, env_additions)`` per server; merge the additions into the launcher's base environment.
    """
    if num_servers < 1 or num_workers < 1:
        raise ValueError(f"need at least one server and one worker, got {num_servers} and {num_workers}")
    missing = [n for n in ("SHOAL_RENDEZVOUS_ADDR", "SHOAL_RENDEZVOUS_PORT", "SHOAL_SECRET") if n not in rendezvous_env]
    if missing:
        raise ValueError(f"dedicated parameter servers need the job's rendezvous variables; missing {missing}")
    processes = []
    for index in range(num_servers):
        env = dict(rendezvous_env)
        env.update(worker_env(num_servers))
        env.update({"SHOAL_PS_ROLE": "server", "SHOAL_PS_SERVER_INDEX": str(index), "SHOAL_PS_NUM_WORKERS": str(num_workers)})
        processes.append(([python, "-m", SERVER_MODULE], env))
    return processes


def worker_env(num_servers: int) -> dict[str, str]:
    """What every worker gets on top of its usual environment when the job has dedicated servers."""
    return {"SHOAL_NUM_SERVERS": str(num_servers)}
