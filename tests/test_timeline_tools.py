"""python -m shoal.timeline summary / plot / merge on timelines recorded from real training steps."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shoal.torch as hvd
from conftest import clean_env
from shoal.testing import run_ranks
from shoal.timeline import Phase, Trace, arrivals, hidden_share, load_trace

STEPS = 5


def _train_a_few_steps(late_rank: int = -1) -> None:
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), bucket_bytes=0
    )
    for _ in range(STEPS):
        optimizer.zero_grad()
        if hvd.rank() == late_rank:
            time.sleep(0.03)  # this rank's gradients arrive last in every exchange
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    hvd.barrier()


def _timeline(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal.timeline", *args], env=clean_env(), capture_output=True, text=True, timeout=60
    )


def test_timeline_summary_and_plot(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    run_ranks(_train_a_few_steps, 2, env={"SHOAL_TIMELINE": str(path)})
    summary = _timeline("summary", str(path))
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    assert lines[1].split() == ["tensor", "exch", "negotiate", "transfer", "wire", "memcpy", "spread", "last"]
    rows = {line.split()[0]: line.split() for line in lines[2:] if line.startswith(("Distributed", "barrier"))}
    assert int(rows["DistributedOptimizer.0.weight"][1]) == STEPS  # five steps, five exchanges of that gradient
    assert re.search(
        rf"compute on rank 0, {STEPS} steps, median ms: forward [\d.]+, backward [\d.]+, "
        r"synchronize [\d.]+, update [\d.]+",
        summary.stdout,
    ), summary.stdout
    assert re.search(r"communication hidden under backward: \d+% of [\d.]+ ms on rank 0", summary.stdout)
    assert lines[-1].startswith("total: negotiation")
    out = tmp_path / "timeline.png"
    drawn = _timeline("plot", str(path), "-o", str(out))
    assert drawn.returncode == 0, drawn.stderr
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000


def test_summary_reads_a_timeline_cut_short_and_refuses_a_file_that_is_no_trace(tmp_path: Path) -> None:
    """A crash leaves the array without its closing bracket and perhaps half a line: that is read (as Chrome's and
    Perfetto's viewers read it); anything else is refused with a clear error and exit 2, never an empty summary."""
    path = tmp_path / "timeline.json"
    run_ranks(_train_a_few_steps, 1, env={"SHOAL_TIMELINE": str(path)})
    text = path.read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.rindex("]")].rstrip()[:-20])  # no bracket, the last event cut in half
    summary = _timeline("summary", str(cut))
    assert summary.returncode == 0, summary.stderr
    assert "DistributedOptimizer.0.weight" in summary.stdout
    one_line = tmp_path / "one_line.json"  # another tool's export: one JSON array
    one_line.write_text(json.dumps([json.loads(line.strip().rstrip(",")) for line in text.splitlines()[1:-1] if line]))
    assert _timeline("summary", str(one_line)).stdout == _timeline("summary", str(path)).stdout
    for name, broken in {
        "broken": '{"broken',
        "object": '{"traceEvents": 3}',
        "middle": '[\n{"ph": "B"},\n{oops\n{"ph": "E"}\n]',
    }.items():
        bad = tmp_path / f"{name}.json"
        bad.write_text(broken)
        refused = _timeline("summary", str(bad))
        assert refused.returncode == 2 and "is not a Shoal timeline" in refused.stderr, (name, refused)
        assert refused.stdout == "", name


def test_rank_zero_timeline_marks_readiness_and_compute_spans_in_order(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    run_ranks(_train_a_few_steps, 2, env={"SHOAL_TIMELINE": str(path)})
    trace = load_trace(str(path))
    assert trace.ranks == [0]  # as Horovod: rank 0 writes it
    # The first exchange of every gradient is negotiated in full: a READY mark for each rank's request.
    first_weight = {m.rank for m in trace.ready if m.tensor == "DistributedOptimizer.0.weight"}
    assert first_weight == {0, 1}
    compute = [p for p in trace.phases if p.compute]
    names = [p.name for p in compute]
    for name in ("FORWARD", "BACKWARD", "SYNCHRONIZE", "UPDATE"):
        assert names.count(name) == STEPS, names
    for step in range(STEPS):  # each step's spans follow each other on the compute row
        forward, backward, sync, update = (
            next(p for i, p in enumerate(compute) if p.name == n and sum(q.name == n for q in compute[:i]) == step)
            for n in ("FORWARD", "BACKWARD", "SYNCHRONIZE", "UPDATE")
        )
        assert forward.end_us <= backward.start_us + 1 and backward.end_us <= sync.start_us + 1
        assert sync.end_us <= update.start_us + 1
        # every reduction of this step ran between the first gradient and the end of synchronize
        transfers = [p for p in trace.phases if p.kind == "transfer" and backward.start_us <= p.start_us <= sync.end_us]
        assert len({p.tensor for p in transfers}) == 4, transfers


@pytest.mark.alone  # the two ranks' starts within 20 ms: a busy neighbour test can delay one rank past that
def test_per_rank_files_merge_onto_one_clock_and_name_the_late_rank(tmp_path: Path) -> None:
    run_ranks(_train_a_few_steps, 2, args=(1,), env={"SHOAL_TIMELINE": str(tmp_path / "tl-{rank}.json")})
    files = [str(tmp_path / "tl-0.json"), str(tmp_path / "tl-1.json")]
    merged = tmp_path / "merged.json"
    result = _timeline("merge", *files, "-o", str(merged))
    assert result.returncode == 0, result.stderr
    events = json.loads(merged.read_text())  # a complete JSON array Perfetto opens
    assert {e["pid"] for e in events if "pid" in e} == {0, 1}
    trace = load_trace(str(merged))
    assert trace.ranks == [0, 1]
    # On one clock, a gradient's reduction starts on both ranks within a few ms of each other.
    starts = {
        r: [
            p.start_us
            for p in trace.phases
            if p.rank == r and p.kind == "transfer" and p.tensor == "DistributedOptimizer.0.weight"
        ]
        for r in (0, 1)
    }
    assert len(starts[0]) == len(starts[1]) == STEPS
    assert max(abs(a - b) for a, b in zip(starts[0], starts[1], strict=True)) < 20_000
    summary = _timeline("summary", *files)  # per-rank files directly, merged on the fly
    assert summary.returncode == 0, summary.stderr
    # Rank 1 listed first: most often last (rank 0 is listed too when start-up made it late once; not always).
    assert re.search(r"arrived last: rank 1 in \d+%, (rank 0 in \d+%, )?all together", summary.stdout), summary.stdout
    # Rank 1 slept 30 ms before every backward: after the first step (start-up skews that one), it is the last to
    # submit every gradient.
    later = [e for name, seen in arrivals(trace).items() if name.startswith("Distributed") for e in seen[1:]]
    assert len(later) == 4 * (STEPS - 1)
    assert sum(max(e, key=e.__getitem__) == 1 for e in later) >= len(later) - 1, later
    assert re.search(r"hidden under backward: .* on rank 0, .* on rank 1", summary.stdout), summary.stdout
    clash = _timeline("merge", files[0], files[0], "-o", str(tmp_path / "x.json"))
    assert clash.returncode == 2 and "rank 0 appears in both" in clash.stderr


def test_hidden_share_counts_collective_time_inside_backward() -> None:
    phases = [
        Phase(0, "compute", "BACKWARD", 0, 10_000, compute=True),
        Phase(0, "g", "ALLREDUCE", 5_000, 15_000),
        Phase(0, "g", "SHM_ALLREDUCE", 5_000, 15_000),
        Phase(0, "compute", "BACKWARD", 20_000, 30_000, compute=True),
        Phase(0, "h", "ALLREDUCE", 20_000, 30_000),
    ]
    total, share = hidden_share(Trace(phases, []))[0]
    assert total == 20.0 and abs(share - 0.75) < 1e-9  # 5 of 10 ms, then 10 of 10 ms; the wire phase not twice
