"""One worker's step, measured on this machine or counted in FLOPs: the input of the step simulator.

``measure_profile`` trains the model for a few steps in ``concurrent`` processes at once (as many as will share the
machine's cores in the job being predicted) and times, per step, the forward pass, the moment each parameter's
gradient becomes final (a post-accumulate-grad hook), the rest of backward and the update; means over steps (a
throughput is a mean: the occasional slow step counts), then over the processes. The processes step in lockstep,
as a synchronous job's ranks do (they leave each step's gradient exchange together): each waits for the others
after backward, so their update and forward passes run at the same time and compete for memory bandwidth as they
will in the job, and the wait for the slowest one, which a job pays too, counts in the update. Left to drift apart,
one process's memory-bound update overlaps another's forward and both look faster than a job can be (on this
project's 2-core machine the MLP's update took 7.4 ms free-running and 11.8 ms in lockstep).

``flop_profile`` derives the same from a FLOP count and a stated device throughput, for hardware one does not have.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from queue import Empty
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from shoal.plan.simulate import Gradient, Layer, StepProfile
from shoal.torch.layer_comm.layers import spares_local_gradient

MakeInput = Callable[[int, torch.Generator], torch.Tensor]
"""Makes one synthetic input batch of a given size."""


def load_model(spec: str) -> tuple[nn.Module, MakeInput]:
    """``cnn``, ``mlp`` or ``transformer`` (the benchmark models), or ``package.module:factory``.

    A factory takes no arguments and returns ``(model, make_input)``, where ``make_input(batch, generator)`` returns
    an input batch for ``model``.
    """
    if ":" not in spec:
        from shoal.predict.models import build

        return build(spec)
    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot load the model factory {spec!r}: {error}") from None
    built = factory()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module) and callable(built[1])):
        raise ValueError(f"the model factory {spec!r} must return (model, make_input), got {type(built).__name__}")
    return built[0], built[1]


def _loss(output: Any) -> torch.Tensor:
    """A loss for any model: cross-entropy against class 0 for (batch, classes) logits, as the benchmarks train,
    else the mean square of the (first) output, in float32."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    if output.dim() == 2 and output.is_floating_point():
        return nn.functional.cross_entropy(output.float(), torch.zeros(output.shape[0], dtype=torch.long))
    return output.float().square().mean()


def _owners(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Modules owning trainable parameters directly (the planner's layers), with their named parameters."""
    owners = {}
    for name, module in model.named_modules():
        params = [(f"{name}.{p}" if name else p, param) for p, param in module.named_parameters(recurse=False)]
        params = [(n, p) for n, p in params if p.requires_grad]
        if params:
            owners[name] = params
    return owners


def _layers(model: nn.Module, rows: dict[str, int]) -> list[Layer]:
    layers = []
    for name, params in _owners(model).items():
        module = model.get_submodule(name)
        nbytes = sum(p.numel() * p.element_size() for _, p in params)
        linear = None
        if isinstance(module, nn.Linear) and name in rows:
            linear = (rows[name], module.out_features, module.in_features)
        shapes = tuple(tuple(p.shape) for _, p in params)
        layers.append(Layer(name, type(module).__name__, nbytes, linear, spares_local_gradient(module), shapes))
    return layers


def _record_rows(model: nn.Module, rows: dict[str, int]) -> list[Any]:
    """Forward hooks noting K (rows per step) of every ``nn.Linear``, as the planner counts them."""
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def hook(mod: nn.Module, args: tuple[Any, ...], out: Any, name: str = name) -> None:
                rows[name] = args[0].numel() // args[0].shape[-1] if args[0].dim() else 1

            handles.append(module.register_forward_hook(hook))
    return handles


def _profile_once(spec: str, batch: int, steps: int, warmup: int, threads: int, lockstep: Any = None) -> dict[str, Any]:
    """Time ``steps`` training steps of one process (see the module's description); ``lockstep``: a barrier shared
    with the other profiling processes, waited on after each backward pass."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, make_input = load_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    inputs = [make_input(batch, generator) for _ in range(2)]
    rows: dict[str, int] = {}
    hooks = _record_rows(model, rows)
    ready: dict[str, float] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for param in model.parameters():
        if param.requires_grad:
            hooks.append(
                param.register_post_accumulate_grad_hook(lambda p: ready.__setitem__(names[id(p)], time.perf_counter()))
            )
    samples: dict[str, list[float]] = {}
    for index in range(warmup + steps):
        ready.clear()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = _loss(model(inputs[index % 2]))
        backward_start = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        if lockstep is not None:
            lockstep.wait(timeout=_LOCKSTEP_TIMEOUT_S)  # untimed: the wait is not part of any phase
        update_start = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        if index < warmup:
            continue
        for key, value in (
            ("forward", backward_start - start),
            ("backward", backward_end - backward_start),
            ("update", end - update_start),
            ("wait", update_start - backward_end),
            *((f"ready:{name}", at - backward_start) for name, at in ready.items()),
        ):
            samples.setdefault(key, []).append(value)
    for handle in hooks:
        handle.remove()
    return {
        "means": {key: statistics.fmean(values) for key, values in samples.items()},
        "rows": rows,
        "flops_per_s": _matmul_rate(),
        "cast_per_byte_s": _cast_cost(),
    }


def _matmul_rate(size: int = 512, repeats: int = 5) -> float:
    left, right = torch.randn(size, size), torch.randn(size, size)
    left @ right
    start = time.perf_counter()
    for _ in range(repeats):
        left @ right
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _cast_cost(nbytes: int = 8 * 1024 * 1024, repeats: int = 5) -> float:
    """Seconds per fp32 byte of casting to float16 and back (what fp16/bf16 add on top of the smaller wire)."""
    tensor = torch.randn(nbytes // 4)
    tensor.to(torch.float16).float()
    start = time.perf_counter()
    for _ in range(repeats):
        tensor.copy_(tensor.to(torch.float16))
    return (time.perf_counter() - start) / repeats / nbytes


_LOCKSTEP_TIMEOUT_S = 120.0
"""How long a profiling process waits for the others at a step (one that died leaves the rest failing, not hung)."""


def _child(queue: Any, args: tuple[str, int, int, int, int], lockstep: Any) -> None:
    try:
        queue.put(("ok", _profile_once(*args, lockstep=lockstep)))
    except BaseException as error:  # reported to the parent, which raises it
        queue.put(("error", repr(error)))


def _collect(queue: Any, procs: list[Any], timeout: float) -> list[tuple[str, Any]]:
    """One reply per process; a process that died without replying is an error at once, not after ``timeout``."""
    replies: list[tuple[str, Any]] = []
    deadline = time.monotonic() + timeout
    while len(replies) < len(procs):
        try:
            replies.append(queue.get(timeout=0.5))
            continue
        except Empty:
            pass
        dead = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"a profiling process exited with code {dead[0]} (its error is above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"profiling took longer than {timeout:.0f} s")
    return replies


def measure_profile(
    spec: str,
    batch: int,
    steps: int = 10,
    warmup: int = 3,
    concurrent: int = 1,
    threads: int | None = None,
    timeout: float = 600,
) -> tuple[StepProfile, float, float]:
    """Profile ``spec`` at ``batch`` per worker in ``concurrent`` processes at once, of ``threads`` compute threads
    each (default: this machine's cores shared among them, as shoalrun shares a host's cores among its workers).

    Returns the profile, the matmul rate (flop/s) and the cast cost (seconds per fp32 byte) measured alongside.
    """
    if batch < 1 or steps < 1 or concurrent < 1:
        raise ValueError("batch, steps and concurrent must be >= 1")
    threads = threads or max(1, (os.cpu_count() or 1) // concurrent)
    if concurrent == 1:
        results = [_profile_once(spec, batch, steps, warmup, threads)]
    else:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        lockstep = ctx.Barrier(concurrent)
        procs = [
            ctx.Process(target=_child, args=(queue, (spec, batch, steps, warmup, threads), lockstep)) for _ in range(concurrent)
        ]
        for proc in procs:
            proc.start()
        try:
            replies = _collect(queue, procs, timeout)
        finally:
            for proc in procs:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
        errors = [detail for status, detail in replies if status != "ok"]
        if errors:
            raise RuntimeError(f"profiling {spec!r} failed: {errors[0]}")
        results = [detail for _, detail in replies]
    means = {key: statistics.fmean(r["means"][key] for r in results) for key in results[0]["means"]}
    model, _ = load_model(spec)
    owners = _owners(model)
    layer_of = {name: layer for layer, params in owners.items() for name, _ in params}
    sizes = {name: p.numel() * p.element_size() for params in owners.values() for name, p in params}
    gradients = [Gradient(layer_of[name], sizes[name], means[f"ready:{name}"]) for name in sizes if f"ready:{name}" in means]
    profile = StepProfile(
        forward_s=means["forward"],
        backward_s=means["backward"],
        update_s=means["update"] + means["wait"],
        batch=batch,
        gradients=gradients,
        layers=_layers(model, results[0]["rows"]),
    )
    flops = statistics.fmean(r["flops_per_s"] for r in results)
    cast = statistics.fmean(r["cast_per_byte_s"] for r in results)
    return profile, flops, cast


def flop_profile(spec: str, batch: int, device_flops: float, device_bytes_per_s: float = 1.5e12) -> StepProfile:
    """The step on a device one does not have (counted on the meta device, so even ImageNet models take a second):
    each layer's forward FLOPs (its own, children excluded) at
    ``device_flops`` per second, backward at twice its forward, gradients final in the reverse of forward order,
    and the update as four passes over the parameters at ``device_bytes_per_s``."""
    if device_flops <= 0:
        raise ValueError(f"--device-flops must be > 0, got {device_flops}")
    with torch.device("meta"):  # shapes and FLOPs only: nothing is allocated or computed
        model, make_input = load_model(spec)
    sample = make_input(1, torch.Generator().manual_seed(0))
    inputs = torch.empty((batch, *sample.shape[1:]), dtype=sample.dtype, device="meta")
    rows: dict[str, int] = {}
    order: list[str] = []
    hooks = _record_rows(model, rows)
    owners = _owners(model)
    for name in owners:
        module = model.get_submodule(name)
        hooks.append(module.register_forward_hook(lambda m, a, o, name=name: order.append(name) if name not in order else None))
    counter = FlopCounterMode(display=False, depth=1000)
    with counter:
        model(inputs)
    for handle in hooks:
        handle.remove()
    counts = {key: sum(ops.values()) for key, ops in counter.get_flop_counts().items()}
    root = type(model).__name__

    def inclusive(name: str) -> float:
        return float(counts.get(f"{root}.{name}" if name else root, 0))

    own = {}
    for name in owners:
        module = model.get_submodule(name)
        children = sum(inclusive(f"{name}.{child}" if name else child) for child, _ in module.named_children())
        own[name] = max(inclusive(name) - children, 0.0)
    forward_s = float(counts.get("Global", sum(own.values()))) / device_flops
    order += [name for name in owners if name not in order]  # modules the forward pass never called
    gradients = []
    elapsed = 0.0
    for name in reversed(order):
        elapsed += 2 * own[name] / device_flops
        gradients += [Gradient(name, p.numel() * p.element_size(), elapsed) for _, p in owners[name]]
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return StepProfile(
        forward_s=forward_s,
        backward_s=max(2 * forward_s, elapsed),
        update_s=4 * nbytes / device_bytes_per_s,
        batch=batch,
        gradients=gradients,
        layers=_layers(model, rows),
    )
