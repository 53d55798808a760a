"""python -m shoal.timeline summary / plot on a timeline recorded from real training steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import shoal.torch as hvd
from conftest import clean_env
from shoal.testing import run_ranks


def _train_a_few_steps() -> None:
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), bucket_bytes=0)  # fmt: skip
    for _ in range(5):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    hvd.barrier()


def test_timeline_summary_and_plot(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    run_ranks(_train_a_few_steps, 2, env={"SHOAL_TIMELINE": str(path)})
    summary = subprocess.run([sys.executable, "-m", "shoal.timeline", "summary", str(path)], env=clean_env(),
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    assert lines[1].split() == ["tensor", "exch", "negotiate", "transfer", "wire", "memcpy"]
    rows = {line.split()[0]: line.split() for line in lines[2:-1]}
    assert int(rows["DistributedOptimizer.0.weight"][1]) == 5  # five steps, five exchanges of that gradient
    assert lines[-1].startswith("total: negotiation")
    out = tmp_path / "timeline.png"
    drawn = subprocess.run([sys.executable, "-m", "shoal.timeline", "plot", str(path), "-o", str(out)],
                           env=clean_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert drawn.returncode == 0, drawn.stderr
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000
