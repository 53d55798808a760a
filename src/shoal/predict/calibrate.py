"""``python -m shoal.predict.calibrate -o FILE``: measure the job's α–β lines for ``shoal.predict --calibration``.

Run it under the launcher on the machines to predict for, e.g. ``shoalrun -np 2 -H a,b python -m
shoal.predict.calibrate -o cal.json``: every rank takes part in the probes (the ones ``comm="auto"`` runs), rank 0
writes the file, with the ranks and hosts that measured it. With several ranks per host the file also holds the
intra-host and inter-host lines.
"""

from __future__ import annotations

import argparse
import os

import shoal.torch as hvd
from shoal.plan.calibration import calibration_to_json
from shoal.torch.layer_comm.calibrate import measure


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shoal.predict.calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("-o", "--output", required=True, help="the calibration file to write (JSON)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per probe, the median kept (default 5)")
    args = parser.parse_args(argv)
    hvd.init()
    try:
        calibration = measure(args.repeats)
        if hvd.rank() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as handle:
                handle.write(calibration_to_json(calibration))
            latency, per_byte = calibration.lines["allreduce"]
            print(
                f"wrote {args.output}: {hvd.size()} ranks on {calibration.measured_on[1] if calibration.measured_on else '?'} "
                f"hosts, allreduce {latency * 1e3:.3f} ms + {1e-9 / per_byte if per_byte else float('inf'):.2f} GB/s",
                flush=True,
            )
    finally:
        hvd.shutdown()


if __name__ == "__main__":
    main()
