"""bench.plot draws every benchmark's --json result (train and rendezvous here; allreduce in test_examples)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.bench.plot import plot_file

RESULTS = {
    "train": {
        "bench": "train",
        "model": "mlp",
        "world": 2,
        "comm": "allreduce",
        "shoal_ips": 1062.7,
        "ddp_ips": 663.0,
        "autotuned_ips": 1016.9,
        "solo_ips": 811.7,
    },
    "rendezvous": {
        "bench": "rendezvous",
        "rows": [{"world": 2, "open_ms": 23.5, "auth_ms": 26.1}, {"world": 4, "open_ms": 64.5, "auth_ms": 58.7}],
    },
}


@pytest.mark.parametrize("bench", sorted(RESULTS))
def test_plot_draws_a_png(tmp_path: Path, bench: str) -> None:
    source = tmp_path / f"{bench}.json"
    source.write_text(json.dumps(RESULTS[bench]))
    png = Path(plot_file(str(source), str(tmp_path / "img")))
    assert png.name == f"{bench}.png" and png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000


def test_plot_refuses_an_unknown_result(tmp_path: Path) -> None:
    source = tmp_path / "other.json"
    source.write_text(json.dumps({"bench": "mystery"}))
    with pytest.raises(SystemExit, match="no plot for bench 'mystery'"):
        plot_file(str(source), str(tmp_path))
