"""Allreduce benchmark: Shoal's engine against raw torch.distributed on the same backend, in the same run.

Run: ``shoalrun -np 2 python -m shoal.bench.allreduce [--max-mib 256] [--iterations 10]``.
Prints a table, then (rank 0) one JSON line:
``{"bench":"allreduce","world":..,"rows":[{"bytes","shoal_ms","raw_ms","ratio","busbw_GBps","hier_ms",
"hier_busbw_GBps"}],"memcpy_GBps":..,"small_tensors":{...},"empty_cycle_ms":..,
"shared_gradients":{"bytes","arena_ms","hier_ms","arena_bytes_moved_per_byte","hier_bytes_moved_per_byte"}}``.
``ratio`` = raw_ms / shoal_ms (> 1: Shoal is faster). ``shoal_ms`` is Shoal's default path through the engine
(negotiation included); ``hier_ms`` is the bare hierarchical/shared-memory transport, present when several ranks
share a host, as is ``shared_gradients``: a 40 MB gradient reduced in the ranks' arenas, against the transport.

The 4 KiB and 64 KiB rows also carry the fixed cost, measured over ``--latency-iterations`` calls after 20 warm-up
calls (a row's ``shoal_ms`` is the median of only ``--iterations``): ``latency_us``, the engine path (a cached request
under its own name: submit, one negotiation cycle, the collective, the wake-up); ``transport_latency_us``, the bare
transport the engine would use (``transport``: "shm" for ranks sharing a host, else "gloo"); ``raw_latency_us``, raw
gloo ``all_reduce``. Each is the slowest rank's median; the three take turns in blocks of 20 calls.
``barrier_us``: the shared-memory barrier's round trip at the end (``shoal.bench.barrier_us``; null without it).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import shoal.torch as hvd
from shoal.bench import add_json_flag, barrier_us, emit, own_local_group
from shoal.comm import collectives
from shoal.comm.hierarchical import HierarchicalAllreduce
from shoal.core import session as handles
from shoal.plan.calibration import median_seconds
from shoal.runtime import context
from shoal.torch import shared_grads


def _timed_ms(fn: Callable[[], object], iterations: int) -> float:
    """Median wall time of ``fn`` in ms, after one warm-up call."""
    return median_seconds(fn, iterations) * 1e3


def memcpy_gbps(nbytes: int = 64 * 1024 * 1024) -> float:
    """Single-process, single-thread copy bandwidth (bytes copied per second), the limit for any local path."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    ms = _timed_ms(lambda: target.copy_(source), 10)
    torch.set_num_threads(threads)
    return nbytes / (ms / 1e3) / 1e9


def _max_ms(value: float) -> float:
    """The slowest rank's time: a collective is only as fast as its last rank."""
    slowest = torch.tensor([value], dtype=torch.float64)
    collectives.allreduce_(slowest, "max", None)
    return float(slowest.item())


def _busbw(nbytes: int, ms: float) -> float:
    """Bus bandwidth in GB/s: the bytes each rank must move in a ring allreduce, per second."""
    size = hvd.size()
    return 2 * (size - 1) / size * nbytes / (ms / 1e3) / 1e9 if size > 1 else 0.0


def build_hierarchical() -> HierarchicalAllreduce | None:
    """The hierarchical transport on a segment of its own (the engine's belongs to the engine thread)."""
    if context.current().topology.cross_size > 1:
        return None  # several hosts: the engine's path is what to measure
    local = own_local_group("bench", handles.engine().config.shm_slot_bytes)
    return HierarchicalAllreduce(local, None, 1) if local is not None else None


LATENCY_SIZES = (4096, 65536)
"""The small sizes whose rows carry the fixed cost (``latency_us`` and its two references)."""


def bench_latency(tensor: torch.Tensor, hierarchical: HierarchicalAllreduce | None, iterations: int) -> dict[str, Any]:
    """Median µs per call, slowest rank: the engine on a cached request, the bare transport, raw gloo.

    The paths take turns in blocks of 20 calls, so that a slow spell of the machine (or of the emulated link)
    falls on all of them alike rather than on whichever ran then.
    """
    name = f"latency.{tensor.numel() * tensor.element_size()}"  # its own cached request per size
    paths: dict[str, Callable[[], object]] = {
        "engine": functools.partial(hvd.allreduce_, tensor, op=hvd.Sum, name=name),
        "raw": functools.partial(collectives.allreduce_, tensor, "sum", None),
    }
    if hierarchical is not None:
        paths["shm"] = functools.partial(hierarchical.allreduce_, tensor, "sum")
    seconds: dict[str, list[float]] = {key: [] for key in paths}
    for fn in paths.values():
        for _ in range(20):  # the first engine calls negotiate and fill the response cache
            fn()
    for start in range(0, iterations, 20):
        for key, fn in paths.items():
            for _ in range(min(20, iterations - start)):
                began = time.perf_counter()
                fn()
                seconds[key].append(time.perf_counter() - began)
    median_us = {key: round(_max_ms(statistics.median(values) * 1e3) * 1e3, 1) for key, values in seconds.items()}
    transport = "shm" if hierarchical is not None else "gloo"
    return {
        "latency_us": median_us["engine"],
        "transport_latency_us": median_us.get("shm", median_us["raw"]),
        "transport": transport,
        "raw_latency_us": median_us["raw"],
    }


_HEADER = f"{'bytes':>12} {'shoal ms':>10} {'raw ms':>10} {'ratio':>7} {'busbw GB/s':>11} {'hier ms':>9}"


def _print_row(row: dict[str, float]) -> None:
    print(
        f"{row['bytes']:>12} {row['shoal_ms']:>10.3f} {row['raw_ms']:>10.3f} {row['ratio']:>7.2f} "
        f"{row['busbw_GBps']:>11.3f} {row.get('hier_ms', float('nan')):>9.3f}",
        flush=True,
    )


def bench_sizes(
    max_bytes: int, iterations: int, hierarchical: HierarchicalAllreduce | None, latency_iterations: int = 300
) -> list[dict[str, Any]]:
    """Shoal's in-place allreduce (its default path), raw all_reduce, and the bare hierarchical transport.

    Rank 0 prints each size's row as soon as it is measured, so a long run shows its progress.
    """
    if hvd.rank() == 0:
        print(_HEADER, flush=True)
    rows = []
    nbytes = 4096
    while nbytes <= max_bytes:
        tensor = torch.ones(nbytes // 4)
        count = max(3, iterations if nbytes <= 16 * 1024 * 1024 else iterations // 3)
        raw_ms = _max_ms(_timed_ms(functools.partial(collectives.allreduce_, tensor, "sum", None), count))
        shoal_ms = _max_ms(_timed_ms(functools.partial(hvd.allreduce_, tensor, op=hvd.Sum, name="bench"), count))
        row = {
            "bytes": nbytes,
            "shoal_ms": round(shoal_ms, 4),
            "raw_ms": round(raw_ms, 4),
            "ratio": round(raw_ms / shoal_ms, 3),
            "busbw_GBps": round(_busbw(nbytes, shoal_ms), 3),
        }
        if hierarchical is not None:
            hier_ms = _max_ms(_timed_ms(functools.partial(hierarchical.allreduce_, tensor, "sum"), count))
            row["hier_ms"] = round(hier_ms, 4)
            row["hier_busbw_GBps"] = round(_busbw(nbytes, hier_ms), 3)
        if nbytes in LATENCY_SIZES:
            row.update(bench_latency(tensor, hierarchical, latency_iterations))
        rows.append(row)
        if hvd.rank() == 0:
            _print_row(row)
        nbytes *= 4
    return rows


def bench_shared_gradients(
    hierarchical: HierarchicalAllreduce | None, limit_gbps: float, nbytes: int = 40 * 10**6
) -> dict[str, float] | None:
    """A 40 MB gradient reduced where it lies in the ranks' arenas (the optimizer's shared-gradient path), against
    the bare shared-memory transport on the same bytes; each as the memory traffic per gradient byte and rank that
    its time implies at the single-core copy bandwidth (a copy moves 2 bytes per byte: one read, one write)."""
    site = handles.engine().transport.arena_site()
    if hierarchical is None or site is None:
        return None
    arena, failure = shared_grads.map_arenas(site, nbytes, "bench.arena")
    if arena is None:
        if hvd.rank() == 0:
            print(f"shared-gradient arena unavailable: {failure}")
        return None
    count = nbytes // 4
    arena.own()[:nbytes].view(torch.float32).fill_(1.0)
    arena_ms = _max_ms(_timed_ms(lambda: arena.allreduce_range_(hierarchical.local, 0, torch.float32, count, "sum"), 5))
    tensor = torch.ones(count)
    hier_ms = _max_ms(_timed_ms(functools.partial(hierarchical.allreduce_, tensor, "sum"), 5))
    arena.close()
    copy_ms = nbytes / (limit_gbps * 1e9) * 1e3
    return {
        "bytes": nbytes,
        "arena_ms": round(arena_ms, 3),
        "hier_ms": round(hier_ms, 3),
        "arena_bytes_moved_per_byte": round(2 * arena_ms / copy_ms, 2),
        "hier_bytes_moved_per_byte": round(2 * hier_ms / copy_ms, 2),
    }


def bench_small_tensors(count: int = 256, bytes_each: int = 16384, repeats: int = 11) -> dict[str, float]:
    """``count`` tensors submitted asynchronously then synchronized, against one blocking raw allreduce each."""
    tensors = [torch.ones(bytes_each // 4) for _ in range(count)]

    def shoal_step() -> None:
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"small.{i}") for i, t in enumerate(tensors)]
        for handle in handles:
            hvd.synchronize(handle)

    def raw_step() -> None:
        for tensor in tensors:
            collectives.allreduce_(tensor, "sum", None)

    shoal_ms = _max_ms(_timed_ms(shoal_step, repeats))
    raw_ms = _max_ms(_timed_ms(raw_step, repeats))
    return {
        "count": count,
        "bytes_each": bytes_each,
        "shoal_ms": round(shoal_ms, 3),
        "raw_per_tensor_ms": round(raw_ms / count, 4),
        "speedup": round(raw_ms / shoal_ms, 2),
    }


def bench_empty_cycle(hierarchical: HierarchicalAllreduce | None, iterations: int = 500) -> float:
    """The steady-state cost of an empty negotiation cycle: the one bitwise-AND of the cycle's bit vector (ms).

    It runs on the path the engine uses for it: shared memory when the engine has it, else gloo.
    """
    engine = handles.engine()
    words = torch.zeros(1 + (engine.config.cache_capacity + 62) // 63, dtype=torch.int64)
    if engine.hierarchical is not None and hierarchical is not None:
        return _max_ms(_timed_ms(lambda: hierarchical.allreduce_(words, "band"), iterations))
    # Several hosts: the engine's own path is shared memory plus gloo between hosts; this measures gloo alone,
    # an upper bound for the cross-host part (reported with "empty_cycle_path").
    return _max_ms(_timed_ms(lambda: collectives.bitwise_and_(words, None), iterations))


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print the table and the JSON line (rank 0)."""
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.allreduce", description=__doc__.split("\n")[0])
    parser.add_argument("--max-mib", type=int, default=256, help="largest message in MiB (default 256)")
    parser.add_argument("--iterations", type=int, default=10, help="timed iterations per size (default 10)")
    parser.add_argument(
        "--latency-iterations",
        type=int,
        default=300,
        help="timed calls for the 4 KiB and 64 KiB fixed-cost fields (default 300)",
    )
    add_json_flag(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    limit = memcpy_gbps()
    hierarchical = build_hierarchical()
    rows = bench_sizes(args.max_mib * 1024 * 1024, args.iterations, hierarchical, args.latency_iterations)
    small = bench_small_tensors()
    empty_cycle_ms = bench_empty_cycle(hierarchical)
    shared = bench_shared_gradients(hierarchical, limit)
    placement = barrier_us()
    if hvd.rank() == 0:
        print(f"memcpy limit: {limit:.2f} GB/s; empty negotiation cycle: {empty_cycle_ms:.4f} ms")
        for row in rows:
            if "latency_us" in row:
                print(
                    f"fixed cost, {row['bytes']} B: engine {row['latency_us']:.1f} us, bare {row['transport']} "
                    f"{row['transport_latency_us']:.1f} us, raw gloo {row['raw_latency_us']:.1f} us"
                )
        print(
            f"{small['count']} x {small['bytes_each']} B: shoal {small['shoal_ms']:.2f} ms, "
            f"raw {small['raw_per_tensor_ms']:.3f} ms per tensor, speedup {small['speedup']:.1f}x"
        )
        result = {
            "bench": "allreduce",
            "world": hvd.size(),
            "rows": rows,
            "memcpy_GBps": round(limit, 3),
            "small_tensors": small,
            "empty_cycle_ms": round(empty_cycle_ms, 4),
            "empty_cycle_path": "shm" if hierarchical is not None else "gloo",
            "shared_gradients": shared,
            "barrier_us": placement,
        }
        if shared is not None:
            print(
                f"{shared['bytes'] / 1e6:.0f} MB gradient: in its arena {shared['arena_ms']:.2f} ms "
                f"({shared['arena_bytes_moved_per_byte']:.2f} bytes moved per byte), through the shared-memory "
                f"transport {shared['hier_ms']:.2f} ms ({shared['hier_bytes_moved_per_byte']:.2f})"
            )
        emit(result, args.json)
    if hierarchical is not None:
        hierarchical.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
