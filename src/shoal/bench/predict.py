"""How good is ``shoal.predict``? Predict, then measure, the same training on emulated hosts.

Run (as root, iproute2, for the namespaces): ``python -m shoal.bench.predict``. For each setting (default: one host
with 2 ranks on shared memory; 2 and 3 network namespaces of one rank at 1 Gbit/s and at 200 Mbit/s), it measures
the network with ``python -m shoal.predict.calibrate`` under that setting's launcher, profiles each model on this
machine with as many processes at once as the setting has ranks (the emulated hosts share this machine's cores),
predicts each ``--comm`` setting from that profile and calibration, then measures it with ``shoal.bench.train``
(``--compare none``, the best of ``--rounds`` phases). Prints a table and, last, one JSON line: ``{"bench":
"predict", "rows": [{"setting", "model", "comm", "predicted_ips", "measured_ips", "error"}], "median_error": ...,
"max_error": ...}`` (errors as fractions of the measured throughput).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any

from shoal.bench import add_json_flag, add_phase_flags, emit, rank0_result
from shoal.plan.calibration import Calibration, calibration_from_json
from shoal.plan.simulate import Links, StepProfile, simulate
from shoal.predict.profile import measure_profile

DEFAULT_SETTINGS = "shm:1x2,1gbit:2x1,1gbit:3x1,200mbit:2x1,200mbit:3x1"


@dataclass(frozen=True)
class Setting:
    """Where a job runs: ``shm`` (one host, shared memory) or a tc rate between ``hosts`` namespaces."""

    link: str
    hosts: int
    ranks_per_host: int

    @classmethod
    def parse(cls, text: str) -> Setting:
        """``LINK:HOSTSxRANKS``, e.g. ``shm:1x2`` or ``1gbit:3x1``."""
        try:
            link, shape = text.split(":")
            hosts, ranks = (int(part) for part in shape.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a setting is LINK:HOSTSxRANKS (shm:1x2, 1gbit:2x1), got {text!r}") from None
        if (link == "shm") != (hosts == 1) or hosts < 1 or ranks < 1 or (hosts > 1 and ranks != 1):
            raise argparse.ArgumentTypeError(f"{text!r}: shm takes one host; emulated hosts take one rank each")
        return cls(link, hosts, ranks)

    @property
    def workers(self) -> int:
        return self.hosts * self.ranks_per_host

    def __str__(self) -> str:
        return f"{self.link}:{self.hosts}x{self.ranks_per_host}"

    def launch(self, *command: str) -> list[str]:
        """``command`` under this setting's launcher (shoalrun locally, or the emulated hosts)."""
        if self.link == "shm":
            return [sys.executable, "-m", "shoal.runner", "-np", str(self.workers), sys.executable, *command]
        launcher = [sys.executable, "-m", "shoal.bench.netns", "--hosts", str(self.hosts), "--rate", self.link, "--"]
        return [*launcher, sys.executable, *command]


def _run(command: list[str], timeout: float, what: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"shoal.bench.predict: {what} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result.stdout


def calibrate(setting: Setting, timeout: float) -> Calibration:
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "calibration.json")
        _run(setting.launch("-m", "shoal.predict.calibrate", "-o", path), timeout, f"calibrating {setting}")
        with open(path) as handle:
            return calibration_from_json(handle.read(), path)


def measure(setting: Setting, model: str, comm: str, args: argparse.Namespace) -> dict[str, Any]:
    command = setting.launch(
        "-m",
        "shoal.bench.train",
        *("--model", model, "--comm", comm, "--compare", "none", "--batch-size", str(args.batch_size)),
        *("--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup)),
    )
    return rank0_result(command, args.timeout, f"shoal.bench.predict: training {model} comm={comm} on {setting}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.predict", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--settings",
        type=lambda text: [Setting.parse(part) for part in text.split(",")],
        default=DEFAULT_SETTINGS,
        help=f"comma-separated LINK:HOSTSxRANKS (default {DEFAULT_SETTINGS})",
    )
    parser.add_argument("--models", default="mlp,cnn,transformer", help="comma-separated (default mlp,cnn,transformer)")
    parser.add_argument("--comms", default="allreduce,auto", help="comma-separated (default allreduce,auto)")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    parser.add_argument("--profile-steps", type=int, default=10, help="steps profiled per model (default 10)")
    add_phase_flags(parser)
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if isinstance(args.settings, str):
        args.settings = [Setting.parse(part) for part in args.settings.split(",")]
    rows = []
    print(f"{'setting':<14} {'model':<12} {'comm':<10} {'predicted':>10} {'measured':>10} {'error':>7}", flush=True)
    for setting in args.settings:
        calibration = calibrate(setting, args.timeout)
        links = Links.from_calibration(calibration, setting.workers, setting.hosts)
        for model in args.models.split(","):
            # Every rank of the setting computes on this machine's cores at once, with one compute thread, as
            # shoal.bench.train runs every rank (two processes of two threads each on two cores ran the CNN 2.2x
            # slower than two of one thread). Profiled right before its measurements, in every setting: this shared
            # VM's speed drifts over a run (a profile reused ten minutes later was 25-33% off for the transformer).
            profile: StepProfile = measure_profile(
                model, args.batch_size, args.profile_steps, concurrent=setting.workers, threads=1
            )[0]
            for comm in args.comms.split(","):
                # Every rank computes on one of this machine's cores, all of them busy: CPU-bound.
                predicted = simulate(profile, links, setting.workers, setting.ranks_per_host, comm, cpu_bound=True)
                measured = measure(setting, model, comm, args)
                error = (predicted.samples_per_s - measured["shoal_ips"]) / measured["shoal_ips"]
                rows.append(
                    {
                        "setting": str(setting),
                        "model": model,
                        "comm": comm,
                        "predicted_ips": round(predicted.samples_per_s, 1),
                        "measured_ips": measured["shoal_ips"],
                        "error": round(error, 3),
                        "predicted_choices": dict(Counter(s.value for s in predicted.choices.values())),
                        "measured_choices": measured.get("plan_choices", {}),
                        "measured_refits": measured.get("plan_refits", 0),
                        "bound_ips": measured.get("bound_ips"),
                        "predicted_compute_ips": round(setting.workers * args.batch_size / profile.compute_s, 1),
                    }
                )
                print(
                    f"{setting!s:<14} {model:<12} {comm:<10} {predicted.samples_per_s:>10.1f} "
                    f"{measured['shoal_ips']:>10.1f} {100 * error:>6.0f}%",
                    flush=True,
                )
    errors = [abs(float(row["error"])) for row in rows]
    print(f"median |error| {100 * statistics.median(errors):.0f}%, largest {100 * max(errors):.0f}%")
    emit(
        {
            "bench": "predict",
            "rows": rows,
            "median_error": round(statistics.median(errors), 3),
            "max_error": round(max(errors), 3),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
