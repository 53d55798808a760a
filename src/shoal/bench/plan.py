"""``python -m shoal.bench.plan --model mlp``: calibrate this job's network and print the per-layer plan.

Run it under the launcher to plan for a real world size: ``shoalrun -np 2 python -m shoal.bench.plan --model mlp``. One
forward pass per rank measures K (rows per step) for every fully-connected layer; then every rank calibrates
together and rank 0 prints the table. As a single process (P = 1) every scheme costs nothing.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import shoal.torch as hvd
from shoal.plan.planner import format_plan
from shoal.predict.models import build
from shoal.torch.layer_comm.calibrate import measure
from shoal.torch.layer_comm.layers import build_plan


def main(argv: list[str] | None = None) -> None:
    """Parse flags, measure K and the network, print the plan on rank 0."""
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["cnn", "mlp", "transformer"], default="mlp")
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default 32)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    model, make_input = build(args.model)
    rows: dict[str, int] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor, name: str = name) -> None:
                rows[name] = inputs[0].numel() // inputs[0].shape[-1]

            hooks.append(module.register_forward_hook(record))
    model(make_input(args.batch_size, torch.Generator().manual_seed(0)))
    names = sorted(rows)
    agreed = hvd.allreduce(torch.tensor([rows[n] for n in names]), op=hvd.Max, name="plan.rows").tolist() if names else []
    calibration = measure()
    plans = build_plan(model, calibration, hvd.size(), dict(zip(names, agreed, strict=True)))
    if hvd.rank() == 0:
        print(format_plan(plans, hvd.size(), calibration))
    hvd.shutdown()


if __name__ == "__main__":
    main()
