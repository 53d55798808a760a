"""A stand-in for Slurm's ``srun`` inside an allocation, for tests: starts SLURM_NTASKS tasks with the variables that
real srun gives each task (block distribution over the allocation's nodes), waits for them, and with
``--kill-on-bad-exit=1`` ends the others when one fails. Every "node" is this machine; the node list names loopback
addresses (``127.0.0.[1-2]``) so that each node's tasks have their own host name, as on a real cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from shoal.runtime.slurm import expand_nodelist


def main() -> int:
    argv = sys.argv[1:]
    kill_on_bad_exit = False
    while argv and argv[0].startswith("-"):
        flag = argv.pop(0)
        kill_on_bad_exit = kill_on_bad_exit or flag in ("--kill-on-bad-exit=1", "-K")
    nodes = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
    tasks = int(os.environ["SLURM_NTASKS"])
    per_node = -(-tasks // len(nodes))
    processes = []
    for rank in range(tasks):
        node = rank // per_node
        env = dict(os.environ)
        env.update(
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank % per_node),
            SLURM_NODEID=str(node),
            SLURM_STEP_ID="0",
            SLURM_STEP_NUM_TASKS=str(tasks),
            SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
            SLURM_STEP_NUM_NODES=str(len(nodes)),
            SLURMD_NODENAME=nodes[node],
        )
        processes.append(subprocess.Popen(argv, env=env, start_new_session=True))
    codes: dict[int, int] = {}
    while len(codes) < len(processes):
        for index, process in enumerate(processes):
            if index not in codes and process.poll() is not None:
                codes[index] = process.returncode
                if process.returncode != 0 and kill_on_bad_exit:
                    for other in processes:
                        if other.poll() is None:
                            os.killpg(other.pid, signal.SIGKILL)
        time.sleep(0.05)
    failed = [code for code in codes.values() if code != 0]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main())
