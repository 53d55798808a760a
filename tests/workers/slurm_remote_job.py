"""shoalrun's static job with every host treated as another machine, run inside a Slurm allocation: each worker then
starts the way a worker on another node of the allocation does, as a one-task Slurm step (``srun``), not over ssh.
Arguments are shoalrun's."""

from __future__ import annotations

import sys

from shoal.runner.cli import parse_args
from shoal.runner.launcher import Job, build_slots
from shoal.runner.spawners import ProcessSpawner


class EveryHostRemote(ProcessSpawner):
    def is_local(self, hostname: str) -> bool:
        return False

    def remote(self, hostname: str) -> bool:
        return True


if __name__ == "__main__":
    config = parse_args(sys.argv[1:])
    sys.exit(Job(config, build_slots(config), spawner=EveryHostRemote()).run())
