"""Autotune while training: samples are scored and logged, every rank applies the same settings at the same cycle,
the best is frozen, and training still matches one process (1e-5)."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

import shoal.torch as hvd
from shoal.testing import run_ranks


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _train(steps: int) -> dict[str, object]:
    hvd.init()
    model = _model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(), bucket_bytes=0
    )
    for step in range(steps):
        x, y = _batch(step, hvd.rank())
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    from shoal.core import session as handles

    engine = handles.engine()
    settings = [engine.tuned.fusion_threshold_bytes, engine.tuned.cycle_time_ms, engine.tuned.bucket_bytes]
    configured = [engine.config.fusion_threshold_bytes, engine.config.cycle_time_ms]
    hvd.barrier()
    weights = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    return {"weights": weights, "settings": settings, "configured": configured}


def test_autotune_samples_logs_freezes_and_keeps_training_exact(tmp_path: Path) -> None:
    log = tmp_path / "autotune.csv"
    env = {
        "SHOAL_AUTOTUNE": "1",
        "SHOAL_AUTOTUNE_LOG": str(log),
        "SHOAL_AUTOTUNE_WARMUP_SAMPLES": "1",
        "SHOAL_AUTOTUNE_STEPS_PER_SAMPLE": "4",
        "SHOAL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "6",
    }
    steps = 60
    results = run_ranks(_train, 2, args=(steps,), env=env, timeout_s=150)
    rows = list(csv.DictReader(log.open()))
    phases = [row["phase"] for row in rows]
    assert phases[0] == "warmup" and phases.count("sample") == 6 and phases[-1] == "best", phases
    best = rows[-1]
    assert float(best["bytes_per_second"]) == max(float(r["bytes_per_second"]) for r in rows if r["phase"] == "sample")
    assert results[0]["settings"] == results[1]["settings"]  # every rank applied the same (frozen) settings
    assert results[0]["settings"][0] == int(best["fusion_threshold_bytes"])  # type: ignore[index]
    # The tuned values are the engine's own; the configuration keeps what was set (here the defaults), as Horovod's
    # ParameterManager keeps its values apart from the user's settings.
    from shoal.engine.config import EngineConfig

    defaults = EngineConfig()
    assert all(r["configured"] == [defaults.fusion_threshold_bytes, defaults.cycle_time_ms] for r in results), results
    # The knobs change how gradients travel, never what they add up to.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        optimizer.zero_grad()
        batches = [_batch(step, rank) for rank in range(2)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    for result in results:
        for got, want in zip(result["weights"], model.parameters(), strict=True):  # type: ignore[call-overload]
            torch.testing.assert_close(torch.tensor(got), want.detach().reshape(-1), rtol=1e-5, atol=1e-5)
