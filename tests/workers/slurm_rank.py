"""One rank of a Slurm test job: init from whatever launched it, allreduce its rank, print one JSON line with what it
learned (the launcher Shoal detected, rank, size, local rank and size, the sum, and the Slurm step it runs in)."""

from __future__ import annotations

import json
import os

import torch

import shoal.torch as hvd
from shoal.runtime.launch_env import detect_launch

torch.set_num_threads(1)
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="ranks")
line = {
    "launcher": detect_launch(os.environ).launcher,
    "rank": hvd.rank(),
    "size": hvd.size(),
    "local_rank": hvd.local_rank(),
    "local_size": hvd.local_size(),
    "sum": float(total),
    "slurm_job": os.environ.get("SLURM_JOB_ID"),
    "slurm_step": os.environ.get("SLURM_STEP_ID"),
}
print(json.dumps(line), flush=True)
hvd.shutdown()
