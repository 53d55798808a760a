"""Local steps with outer updates (``comm="local"``, DiLoCo): exact where it must be (H = 1 is synchronous SGD), one
outer step as a numpy hand computation says, the codecs' error feedback, hosts of several ranks kept equal, the
planner's choices from given calibrations, and the API's errors."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import shoal.torch as hvd
from conftest import clean_env, needs_netns
from shoal.bench.accuracy import build_model
from shoal.config.worker import SlotInfo
from shoal.core.session import engine
from shoal.engine.cycle import QUIET_CYCLES
from shoal.plan.calibration import Calibration, calibration_to_json
from shoal.plan.costs import CostContext, LayerShape
from shoal.plan.far import (
    OVERLAP_SLACK,
    LocalSteps,
    RoundPlan,
    fragment_bounds,
    plan_rounds,
    prefer_local,
    replan,
    wire_floor,
)
from shoal.plan.outer_wire import INT8_CHUNK, WIRE_FRAMING, Codec, exchange_parts, exchange_seconds
from shoal.plan.schemes import AUTO_SCHEMES, COMPRESSED, ROWS, Planned, Scheme, estimates
from shoal.testing import run_ranks
from shoal.torch.host_groups import HostGroups
from shoal.torch.local_steps import QUIET_AFTER
from shoal.torch.optimizer import rounds_of
from shoal.torch.outer_codec import Feedback, decode, int4_decode, int4_encode, int8_decode, int8_encode
from shoal.torch.outer_link import OuterLink
from shoal.torch.round_times import busy_seconds

pytestmark = pytest.mark.timeout(120)

ATOL = 1e-5
"""N hosts × batch B against one process over N·B: float32 sums in another order, a few steps."""


def hosts_env(layout: list[int]) -> dict[int, dict[str, str]]:
    """run_ranks' per-rank environment for hosts of ``layout[h]`` ranks each (rank order: host by host)."""
    size = sum(layout)
    env: dict[int, dict[str, str]] = {}
    rank = 0
    for host, count in enumerate(layout):
        for local in range(count):
            env[rank] = SlotInfo(f"host{host}", rank, size, local, count, host, len(layout)).to_env()
            rank += 1
    return env


def _data(rows: int, steps: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(steps, rows, 6, generator=generator), torch.randn(steps, rows, 2, generator=generator)


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _reference(size: int, rows: int, steps: int) -> dict[str, np.ndarray]:
    """One process over the global batch, plain SGD."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(size * rows, steps)
    for step in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[step]), y[step]).backward()
        optimizer.step()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _train_sync_equivalent(rows: int, steps: int, codec: str) -> dict[str, np.ndarray]:
    """H = 1, outer SGD at learning rate 1 without momentum: each rank its own host."""
    hvd.init()
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    options = hvd.LocalSteps(every=1, codec=codec, outer_lr=1.0, outer_momentum=0.0, overlap=False)
    optimizer = hvd.DistributedOptimizer(inner, model=model, comm="local", local_steps=options)
    x, y = _data(hvd.size() * rows, steps)
    mine = slice(hvd.rank() * rows, (hvd.rank() + 1) * rows)
    for step in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[step][mine]), y[step][mine]).backward()
        optimizer.step()
    assert rounds_of(optimizer).rounds == steps  # type: ignore[union-attr]
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("size", [2, 3])
def test_one_step_rounds_equal_one_process_over_the_global_batch(size: int) -> None:
    expected = _reference(size, 4, 5)
    results = run_ranks(
        _train_sync_equivalent, size, args=(4, 5, "fp32"), rank_env_overrides=hosts_env([1] * size), timeout_s=90
    )
    for rank, weights in enumerate(results):
        for name, value in expected.items():
            np.testing.assert_allclose(weights[name], value, atol=ATOL, err_msg=f"rank {rank}, {name}")


# ----- one outer step against numpy -----

ROUNDS, EVERY, INNER_LR, OUTER_LR, MOMENTUM = 3, 4, 0.05, 0.7, 0.9
HAND_CASES = [  # (overlap, fragments, delay): the whole model landing a round later, or in two fragments a step later
    (False, 1, None),
    (True, 1, EVERY),
    (False, 2, None),
    (True, 2, 1),
]


def _linear_data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11 + rank)
    return rng.standard_normal((ROUNDS * EVERY, 5, 4)), rng.standard_normal((ROUNDS * EVERY, 5, 3))


def _train_linear(overlap: bool, fragments: int, delay: int | None) -> dict[str, np.ndarray]:
    """A linear layer, loss ½·Σ(xWᵀ + b - y)² / B, DiLoCo's defaults but for the learning rates; the weight and the
    bias are a fragment each where there are two. The hosts meet at the end (``outer_step``)."""
    hvd.init()
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    options = hvd.LocalSteps(
        every=EVERY,
        codec="fp32",
        outer_lr=OUTER_LR,
        outer_momentum=MOMENTUM,
        overlap=overlap,
        fragments=fragments,
        delay=delay,
    )
    optimizer = hvd.DistributedOptimizer(inner, comm="local", local_steps=options)
    outer = rounds_of(optimizer)
    assert outer is not None and outer.fragments == fragments
    x, y = _linear_data(hvd.rank())
    for step in range(ROUNDS * EVERY):
        optimizer.zero_grad()
        batch = torch.from_numpy(x[step]).float()
        (0.5 * ((model(batch) - torch.from_numpy(y[step]).float()) ** 2).sum() / len(batch)).backward()
        optimizer.step()
    optimizer.outer_step()
    return {name: p.detach().numpy().astype(np.float64) for name, p in model.named_parameters()}


def _numpy_diloco(start: dict[str, np.ndarray], hosts: int, overlap: bool, fragments: int, delay: int | None):
    """The same rounds by hand, step by step. Fragment f (the weight, then the bias; or both as one) is sent at inner
    step (f + 1)·H / fragments of each round: the hosts' mean of its start minus its weights. It lands τ steps later
    (at once without overlap; before it is sent again): an outer Nesterov step from its start, plus the inner steps
    each host took since it sent. At the end the hosts meet: what is in flight lands, then every fragment is
    averaged."""
    data = [_linear_data(rank) for rank in range(hosts)]
    groups = [["weight", "bias"]] if fragments == 1 else [["weight"], ["bias"]]
    outer_start = {name: value.copy() for name, value in start.items()}
    momentum: dict[str, np.ndarray] = {}
    local = [{name: value.copy() for name, value in start.items()} for _ in range(hosts)]
    in_flight: dict[int, tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]], int]] = {}

    def land(fragment: int, average: bool = False) -> None:
        mean, sent, _ = in_flight.pop(fragment)
        for name in groups[fragment]:
            if average:
                outer_start[name] = outer_start[name] - mean[name]
            else:  # torch's SGD: the buffer starts as the first gradient; Nesterov
                momentum[name] = MOMENTUM * momentum[name] + mean[name] if name in momentum else mean[name].copy()
                outer_start[name] = outer_start[name] - OUTER_LR * (mean[name] + MOMENTUM * momentum[name])
            for weights, was in zip(local, sent, strict=True):
                weights[name] = outer_start[name] + (weights[name] - was[name])

    def send(fragment: int) -> None:
        names = groups[fragment]
        mean = {name: np.mean([outer_start[name] - weights[name] for weights in local], axis=0) for name in names}
        in_flight[fragment] = (mean, [{name: weights[name].copy() for name in names} for weights in local], 0)

    steps, sent_in_round = 0, 0
    for step in range(ROUNDS * EVERY):
        for (x, y), weights in zip(data, local, strict=True):
            error = x[step] @ weights["weight"].T + weights["bias"] - y[step]
            weights["weight"] -= INNER_LR * error.T @ x[step] / len(x[step])
            weights["bias"] -= INNER_LR * error.sum(axis=0) / len(x[step])
        steps += 1
        in_flight = {f: (mean, sent, age + 1) for f, (mean, sent, age) in in_flight.items()}
        due = []
        while sent_in_round < fragments and steps >= (sent_in_round + 1) * EVERY // fragments:
            due.append(sent_in_round)
            sent_in_round += 1
        for fragment in sorted(set(f for f, (_, _, age) in in_flight.items() if age >= (delay or 0)) | set(due)):
            if fragment in in_flight:
                land(fragment)
        for fragment in due:
            send(fragment)
            if not overlap:
                land(fragment)
        if sent_in_round == fragments:
            steps, sent_in_round = 0, 0
    for fragment in sorted(in_flight):
        land(fragment)
    for fragment in range(fragments):
        send(fragment)
        land(fragment, average=True)
    return local[0]


@pytest.mark.parametrize(("overlap", "fragments", "delay"), HAND_CASES)
def test_outer_nesterov_steps_match_a_numpy_hand_computation(overlap: bool, fragments: int, delay: int | None) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    start = {name: p.detach().numpy().astype(np.float64) for name, p in model.named_parameters()}
    expected = _numpy_diloco(start, 2, overlap, fragments, delay)
    results = run_ranks(_train_linear, 2, args=(overlap, fragments, delay), rank_env_overrides=hosts_env([1, 1]), timeout_s=90)
    assert not np.allclose(expected["weight"], start["weight"], atol=1e-3)  # the rounds moved the weights
    for other in HAND_CASES:  # each way of landing gives other weights
        if other != (overlap, fragments, delay):
            assert not np.allclose(expected["weight"], _numpy_diloco(start, 2, *other)["weight"], atol=1e-4)
    for rank, result in enumerate(results):
        for name in ("weight", "bias"):
            np.testing.assert_allclose(result[name], expected[name], atol=1e-5, err_msg=f"rank {rank}, {name}")


# ----- the codecs -----


def test_int8_codes_a_chunk_by_its_largest_magnitude() -> None:
    values = torch.zeros(INT8_CHUNK + 3)
    values[0], values[1], values[2] = 1.27, -0.635, 0.004  # scale 0.01: codes 127, -64 (-63.5 rounds to even), 0
    values[INT8_CHUNK] = -2.54  # the second chunk: scale 0.02
    codes, scales = int8_encode(values)
    assert codes.dtype == torch.int8 and codes.numel() == values.numel() and scales.numel() == 2
    np.testing.assert_allclose(scales.numpy(), [0.01, 0.02], rtol=1e-6)
    assert codes[:3].tolist() == [127, -64, 0] and codes[INT8_CHUNK].item() == -127
    decoded = int8_decode(codes, scales, values.numel())
    np.testing.assert_allclose(decoded[:3].numpy(), [1.27, -0.64, 0.0], atol=1e-6)


def test_int4_packs_two_codes_to_a_byte_low_nibble_first() -> None:
    values = torch.zeros(INT8_CHUNK + 3)  # odd: the last byte holds one code and the padding's 8
    values[0], values[1], values[2], values[3] = 0.7, -0.35, 0.04, -0.7  # scale 0.1: codes 7, -4 (-3.5 to even), 0, -7
    values[INT8_CHUNK + 2] = 1.4  # the second chunk: scale 0.2, its last entry 7
    codes, scales = int4_encode(values)
    assert codes.dtype == torch.uint8 and codes.numel() == (values.numel() + 1) // 2 == INT8_CHUNK // 2 + 2
    assert 4 * scales.numel() + codes.numel() == Codec.INT4.wire_bytes(values.numel())
    np.testing.assert_allclose(scales.numpy(), [0.1, 0.2], rtol=1e-6)
    # stored plus 8: (7+8) | (-4+8) << 4 = 0x4F, (0+8) | (-7+8) << 4 = 0x18, zeros 0x88; the last: 15 | 8 << 4
    assert codes[:3].tolist() == [0x4F, 0x18, 0x88] and codes[-1].item() == 0x8F
    decoded = int4_decode(codes, scales, values.numel())
    assert decoded.numel() == values.numel()
    np.testing.assert_allclose(decoded[:4].numpy(), [0.7, -0.4, 0.0, -0.7], atol=1e-6)
    assert decoded[INT8_CHUNK + 2].item() == pytest.approx(1.4) and decoded[INT8_CHUNK : INT8_CHUNK + 2].abs().max() == 0


def test_int8_feedback_carries_the_residual_into_the_next_round() -> None:
    feedback = Feedback(Codec.INT8)
    first = torch.zeros(INT8_CHUNK)
    first[0], first[1] = 1.27, 0.004  # 0.004 rounds to 0 at scale 0.01: left in the residual
    sent = decode(Codec.INT8, feedback.encode(first), INT8_CHUNK)
    assert sent[1].item() == 0.0
    assert feedback.residual is not None and feedback.residual[1].item() == pytest.approx(0.004, abs=1e-7)
    second = torch.zeros(INT8_CHUNK)
    second[0], second[1] = 0.0127, 0.004  # scale 0.0001 · 127: 0.004 + 0.004 carried = 0.008, within the range
    second_sent = decode(Codec.INT8, feedback.encode(second), INT8_CHUNK)
    assert second_sent[1].item() == pytest.approx(0.008, abs=1e-4)


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4, Codec.BF16])
def test_codec_error_does_not_accumulate_over_rounds(codec: Codec) -> None:
    generator = torch.Generator().manual_seed(1)
    feedback = Feedback(codec)
    truth = torch.zeros(4 * INT8_CHUNK)
    sent = torch.zeros_like(truth)
    worst = []
    for _ in range(200):
        delta = torch.randn(truth.numel(), generator=generator) * 1e-2
        truth += delta
        sent += decode(codec, feedback.encode(delta), truth.numel())
        worst.append(float((truth - sent).abs().max()))
    # What was sent in all trails the truth by exactly this round's residual: one rounding, never 200 of them.
    assert feedback.residual is not None
    np.testing.assert_allclose((truth - sent).numpy(), feedback.residual.numpy(), atol=1e-5)
    assert max(worst[100:]) < 2 * max(worst[:10]) + 1e-6


def _exchange_through_codec_changes(count: int) -> list[float]:
    hvd.init()
    link = OuterLink(HostGroups.register())
    generator = torch.Generator().manual_seed(hvd.rank())
    total, means = torch.zeros(count), torch.zeros(count)
    for round_, codec in enumerate([Codec.INT8, Codec.INT4, Codec.INT4, Codec.FP32]):
        delta = torch.randn(count, generator=generator) * 1e-2
        total += delta
        means += link.mean(link.send(codec, 0, delta.clone(), delta, round_, round_))
    return [*means.tolist(), *total.tolist()]


def test_a_change_of_codec_carries_the_residual_and_loses_nothing() -> None:
    """Two hosts exchange one fragment in int8, int4 twice, then fp32 (a re-plan may change the codec): each lossy
    round leaves a residual, carried into the next codec's values and sent in full by fp32, so the hosts' means add
    up to the mean of everything each host sent (to float32's rounding); without the carry they miss by a residual."""
    count = 3 * INT8_CHUNK + 5
    results = run_ranks(_exchange_through_codec_changes, 2, args=(count,), rank_env_overrides=hosts_env([1, 1]), timeout_s=60)
    means = [np.array(r[:count]) for r in results]
    totals = [np.array(r[count:]) for r in results]
    np.testing.assert_array_equal(means[0], means[1])
    np.testing.assert_allclose(means[0], (totals[0] + totals[1]) / 2, atol=1e-6)
    assert np.abs(means[0]).max() > 1e-2  # the deltas are not lost in the rounding either


# ----- hosts of several ranks -----


def _train_two_hosts(steps: int, every: int, overlap: bool, fragments: int, codec: str) -> dict[str, object]:
    hvd.init()
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    options = hvd.LocalSteps(codec=codec, overlap=overlap, fragments=fragments)
    optimizer = hvd.DistributedOptimizer(inner, model=model, comm="local", every=every, local_steps=options)
    x, y = _data(4 * 3, steps, seed=hvd.rank())
    snapshots = []
    for step in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[step]), y[step]).backward()
        optimizer.step()
        snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy())
    assert optimizer.outer_step()  # the last inner steps meet too (and no host shuts down while another exchanges)
    snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy())
    assert not optimizer.outer_step()  # nothing left to meet on
    outer = rounds_of(optimizer)
    assert outer is not None
    sizes = [span.stop - span.start for span in outer.cut.spans]
    return {
        "snapshots": snapshots,
        "rounds": outer.rounds,
        "sent": outer.link.sent_bytes,
        "leader": outer.groups.leader,
        "sizes": sizes,
        "quiet_after": engine().pauses.quiet_after,
    }


@pytest.mark.parametrize(("overlap", "fragments", "codec"), [(False, 1, "int8"), (True, 1, "int8"), (True, 3, "int4")])
def test_ranks_of_a_host_stay_equal_and_hosts_meet_at_every_outer_step(overlap: bool, fragments: int, codec: str) -> None:
    """Without overlap the hosts of one fragment are equal after every outer step; with it, a round's mean lands
    later on top of each host's own steps, and in fragments each lands on its own step, so they meet only at
    ``outer_step()``. Each host sends its codec's bytes (int8's, or int4's two codes to a byte)."""
    steps, every = 7, 3
    env = hosts_env([2, 2])
    args = (steps, every, overlap, fragments, codec)
    results = run_ranks(_train_two_hosts, 4, args=args, rank_env_overrides=env, timeout_s=90)
    assert [r["leader"] for r in results] == [True, False, True, False]
    # hosts of two ranks exchange every step in cycles the whole job joins: their engines keep the default back-off
    assert all(r["rounds"] == steps // every + 1 and r["quiet_after"] == QUIET_CYCLES for r in results)
    sizes = results[0]["sizes"]
    assert len(sizes) == fragments and sum(sizes) == results[0]["snapshots"][0].size
    np.testing.assert_array_equal(results[0]["snapshots"][-1], results[2]["snapshots"][-1])
    for step in range(steps):
        for a, b in ((0, 1), (2, 3)):  # inside a host: equal after every inner step
            np.testing.assert_array_equal(results[a]["snapshots"][step], results[b]["snapshots"][step])
        if (step + 1) % every == 0 and not overlap:  # across hosts: equal after every outer step
            np.testing.assert_array_equal(results[0]["snapshots"][step], results[2]["snapshots"][step])
        else:  # and apart in between (each host trains on its own data)
            assert not np.array_equal(results[0]["snapshots"][step], results[2]["snapshots"][step])
    # every fragment in each whole round and at the meeting, and those due in the last round's steps
    partial = [f for f in range(fragments) if (f + 1) * every // fragments <= steps % every]
    wire = Codec(codec).wire_bytes
    sent = (steps // every + 1) * sum(wire(size) for size in sizes)
    assert results[0]["sent"] == sent + sum(wire(sizes[f]) for f in partial)
    assert results[1]["sent"] == 0  # only a host's first rank crosses the link


# ----- the planner -----

SLOW = Calibration.uniform(30e-3, 1 / 12.5e6, 5e9)  # 100 Mbit/s, 30 ms
SHARED_MEMORY = Calibration.uniform(20e-6, 1 / 5e9, 5e9)


def test_planner_takes_local_steps_on_a_slow_link_and_stays_synchronous_on_shared_memory() -> None:
    entries, step_s = 2_000_000, 0.01  # 8 MB of float32, 10 ms per step
    sync_comm = SLOW.seconds("allreduce", 4 * entries)
    rounds = plan_rounds(SLOW, 2, entries, step_s)
    assert rounds.codec is Codec.INT8 and rounds.overlap  # the cheapest exchange needs the shortest round
    wire, local = exchange_parts(SLOW, 2, entries, Codec.INT8)
    assert rounds.every == int(np.ceil(max(OVERLAP_SLACK * wire, local / 0.05) / step_s)) > 20  # above the floor
    assert rounds.fits and rounds.per_step_s == pytest.approx(step_s + local / rounds.every)
    assert prefer_local(step_s + sync_comm, rounds)
    waiting = plan_rounds(SLOW, 2, entries, step_s, LocalSteps(overlap=False))  # now the wire, not the work, decides
    assert waiting.codec is Codec.INT4
    wire, local = exchange_parts(SLOW, 2, entries, Codec.INT4)
    assert waiting.every == int(np.ceil((wire + local) / (0.05 * step_s))) > rounds.every  # hiding it takes fewer steps
    one_host = plan_rounds(SHARED_MEMORY, 1, entries, step_s)  # shared memory: the ranks of one host
    assert not prefer_local(step_s + SHARED_MEMORY.seconds("allreduce", 4 * entries), one_host)
    fast = plan_rounds(SHARED_MEMORY, 2, entries, 10 * step_s)  # a fast link whose exchange is a small share
    assert not prefer_local(10 * step_s + SHARED_MEMORY.seconds("allreduce", 4 * entries), fast)
    assert not prefer_local(1.0, plan_rounds(SLOW, 1, entries, step_s))  # one host: nothing to gain
    assert plan_rounds(SLOW, 2, 1000, step_s, LocalSteps(codec="int8")).every == 28  # the wire share's floor for int8
    tiny = plan_rounds(SLOW, 2, 1000, step_s)  # a tiny model's round: int4's floor (14) is under the planner's 20
    assert tiny.every == 20 and tiny.codec is Codec.INT4


def test_where_codecs_tie_on_the_round_the_plan_sends_the_fewest_bytes_that_cost_no_time() -> None:
    free = LocalSteps(wire_share=None)  # no floor from the bytes: every codec's round is the floor's 20 steps
    rounds = plan_rounds(SLOW, 2, 471_000, 0.024, free)  # the chars bench's model and step
    assert rounds.every == 20 and rounds.codec is Codec.INT4
    int8 = plan_rounds(SLOW, 2, 471_000, 0.024, LocalSteps(wire_share=None, codec="int8"))
    fp32 = plan_rounds(SLOW, 2, 471_000, 0.024, LocalSteps(wire_share=None, codec="fp32"))
    assert int8.every == fp32.every == 20 and rounds.wire_s < int8.wire_s < fp32.wire_s / 2  # 30 ms of latency each
    entries = 4_000_000  # on shared memory the codecs' work, not the wire, is the cost
    int8_local = exchange_parts(SHARED_MEMORY, 2, entries, Codec.INT8)[1]
    step_s = int8_local / (20 * 0.04)  # int8 would add 4% to a step, bf16 (5 passes of its 8) 2.5%
    costly = plan_rounds(SHARED_MEMORY, 2, entries, step_s, free)
    assert costly.every == 20 and costly.codec is Codec.FP32
    cheap = plan_rounds(SHARED_MEMORY, 2, entries, step_s * 1.6, free)  # bf16 adds 1.6%, int8 2.5%
    assert cheap.every == 20 and cheap.codec is Codec.BF16


def test_the_wire_share_sets_the_shortest_round_per_codec() -> None:
    entries = 471_000
    # per link: int8 sends (N-1)·(1 + 4/256) bytes per entry, framed, against a ring's 2(N-1)/N·4 of float32
    for hosts, codec in [(2, Codec.INT8), (3, Codec.INT8), (8, Codec.INT8), (2, Codec.BF16), (2, Codec.FP32), (3, Codec.INT4)]:
        share = (hosts - 1) if codec.gathered else 2 * (hosts - 1) / hosts
        ratio = WIRE_FRAMING * share * codec.wire_bytes(entries) / (2 * (hosts - 1) / hosts * 4 * entries)
        floor = wire_floor(codec, hosts, entries, LocalSteps())
        assert floor == math.ceil(ratio * 100 - 1e-9) and ratio / floor <= 0.01 < ratio / (floor - 1)
    assert [wire_floor(codec, 2, entries, LocalSteps()) for codec in Codec] == [107, 54, 28, 14]  # fp32, bf16, int8, int4
    assert (
        wire_floor(Codec.INT8, 1, entries, LocalSteps()) == 1 == wire_floor(Codec.INT8, 2, entries, LocalSteps(wire_share=None))
    )
    rounds = plan_rounds(SLOW, 2, entries, 0.024, LocalSteps(codec="int8"))  # every codec hides in 20 steps
    assert rounds.every == 28 and rounds.codec is Codec.INT8 and rounds.wire_floor == 28
    again = replan(rounds, 1e-3, 0.0, 0.024, LocalSteps(codec="int8"))  # a faster link measured: the floor holds
    assert again.every == 28 and again.wire_floor == 28
    chosen = plan_rounds(SLOW, 2, entries, 0.024)  # the bytes decide: int4 is within its floor at the planner's 20
    assert chosen.every == 20 and chosen.codec is Codec.INT4 and chosen.wire_floor == 14
    assert plan_rounds(SLOW, 2, entries, 0.024, LocalSteps(every=7)).every == 7  # a given H is kept
    with pytest.raises(ValueError, match="wire_share must be in"):
        LocalSteps(wire_share=0)


def test_re_planning_chooses_the_codec_again_from_the_measured_wire() -> None:
    """A rate shaper lets the calibration's small probes through at full speed: the first plan takes int8 at its
    wire floor, for a round predicted at 5 ms. The round measured 1.07 s on the wire (10 Mbit/s): priced from that,
    int4 sends half the bytes and hides in half the steps, so the re-plan takes it; a given codec stays."""
    fast = Calibration.uniform(1e-3, 1 / 1.25e9, 5e9)
    entries, step_s = 1_126_410, 0.006  # bench.far's digits MLP
    first = plan_rounds(fast, 2, entries, step_s, LocalSteps(), fragments=4)
    assert (first.codec, first.every, first.entries) == (Codec.INT8, 31, entries) and first.wire_s < 0.01
    again = replan(first, 1.07, first.local_s, step_s, LocalSteps())
    sent = Codec.INT4.wire_bytes(entries) / Codec.INT8.wire_bytes(entries)
    assert again.codec is Codec.INT4 and again.wire_s == pytest.approx(1.07 * sent)
    assert again.local_s == pytest.approx(first.codec_local[3]) and again.wire_floor == 14
    assert again.every == math.ceil(OVERLAP_SLACK * again.wire_s / step_s) == 136
    kept = replan(first, 1.07, first.local_s, step_s, LocalSteps(codec="int8"))
    assert kept.codec is Codec.INT8 and kept.every == math.ceil(OVERLAP_SLACK * 1.07 / step_s)
    unknown = replan(dataclasses.replace(first, entries=0), 1.07, first.local_s, step_s, LocalSteps())
    assert unknown.codec is Codec.INT8  # a plan that does not know the model keeps its codec
    fast_again = replan(again, 1e-3, again.local_s, step_s, LocalSteps())  # the link fast again: the work decides
    assert (fast_again.codec, fast_again.every) == (Codec.INT8, 31) == (first.codec, first.every)


def test_tau_hides_the_largest_fragment_and_a_round_s_wire_is_the_link_s_busy_time() -> None:
    """The digits MLP's 1024×1024 layer is 93% of its entries, a fragment on its own: τ hides that fragment, not the
    mean one (which landed late every round at 10 Mbit/s). Fragments in flight at once share the link: a round's wire
    is the union of their spans."""
    model = build_model("mlp", 1024)
    sizes = [param.numel() for param in model.parameters()]
    entries, step_s = sum(sizes), 0.005
    slow = Calibration.uniform(1e-3, 1 / 1.25e6, 5e9)  # 10 Mbit/s
    rounds = plan_rounds(slow, 2, entries, step_s, LocalSteps(codec="int4"), fragments=4, sizes=sizes)
    assert rounds.fragments == 4 and rounds.largest_part == pytest.approx(1024 * 1024 / entries) and rounds.largest_part > 0.9
    assert rounds.fragment_wire_s == pytest.approx(rounds.wire_s * rounds.largest_part)
    assert rounds.tau == math.ceil(OVERLAP_SLACK * rounds.fragment_wire_s / step_s) > 2 * rounds.every / 4
    assert rounds.fits and rounds.tau <= rounds.every
    equal = plan_rounds(slow, 2, entries, step_s, LocalSteps(codec="int4"), fragments=4)  # parts not known
    assert equal.largest_part == 0 and equal.fragment_wire_s == pytest.approx(equal.wire_s / 4)
    assert equal.tau < rounds.tau
    assert busy_seconds([(0.0, 1.0), (0.5, 1.5), (3.0, 4.0), (3.2, 3.4)]) == pytest.approx(2.5)
    assert busy_seconds([]) == 0.0


def test_the_plan_says_when_the_exchange_cannot_hide() -> None:
    capped = plan_rounds(SLOW, 2, 9_400_000, 1e-3, LocalSteps(max_every=40))
    assert capped.every == 40 and not capped.fits
    assert "does not fit in the 40 ms of a round" in capped.describe()
    assert capped.per_step_s > 1e-3 + (capped.wire_s - 40e-3) / 40


def test_a_given_round_length_is_kept_and_the_cap_holds() -> None:
    rounds = plan_rounds(SLOW, 2, 9_400_000, 0.03, LocalSteps(every=7))  # the codec of the cheapest exchange
    assert rounds.every == 7 and rounds.codec is Codec.INT4
    assert rounds.exchange_s < plan_rounds(SLOW, 2, 9_400_000, 0.03, LocalSteps(every=7, codec="int8")).exchange_s
    capped = plan_rounds(SLOW, 2, 9_400_000, 1e-6, LocalSteps(max_every=40, codec="fp32"))
    assert capped.every == 40 and capped.codec is Codec.FP32


def test_fragments_are_runs_of_whole_parameters_of_about_equal_entries() -> None:
    assert fragment_bounds([10, 10, 10, 10], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert fragment_bounds([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    assert fragment_bounds([1, 2, 3, 4, 5, 6, 7, 8], 3) == [(0, 4), (4, 6), (6, 8)]  # 10, 11 and 15 entries
    assert fragment_bounds([48, 8, 16, 2], 3) == [(0, 1), (1, 2), (2, 4)]  # a weight larger than its share alone
    assert fragment_bounds([1, 1, 1, 100], 4) == [(0, 3), (3, 4)]  # fewer: the last parameter holds most entries
    assert fragment_bounds([10, 10, 10], 5) == [(0, 1), (1, 2), (2, 3)]
    assert fragment_bounds([10, 10, 10], 1) == [(0, 3)] and fragment_bounds([], 3) == []


def test_the_plan_cuts_fragments_where_the_link_carries_bytes_and_not_where_its_latency_dominates() -> None:
    entries, step_s = 20_000_000, 0.1  # 80 MB of float32 on 100 Mbit/s: the bytes dominate
    whole = plan_rounds(SLOW, 2, entries, step_s, fragments=1)
    cut = plan_rounds(SLOW, 2, entries, step_s, fragments=4)
    assert cut.fragments == 4 and cut.codec is whole.codec and cut.every <= 1.1 * whole.every
    wire, _ = exchange_parts(SLOW, 2, entries, cut.codec, 4)
    assert wire == pytest.approx(exchange_parts(SLOW, 2, entries, cut.codec)[0] + 3 * 30e-3)  # a latency each
    hides = math.ceil(OVERLAP_SLACK * wire / 4 / step_s)  # the fewest steps that hide a fragment's wire
    assert cut.tau == max(hides, math.ceil(cut.every / 4)) < cut.every and cut.fits  # and one fragment's spacing
    assert whole.tau == whole.every  # one fragment lands at the next round's end
    assert "in 4 fragments, each landing" in cut.describe()
    assert cut.as_dict()["fragments"] == 4 and cut.as_dict()["delay"] == cut.tau
    tiny = plan_rounds(SLOW, 2, 20_000, 1e-3, fragments=4)  # 20 kB: four latencies would lengthen the round
    assert tiny.fragments == 1
    waiting = plan_rounds(SLOW, 2, entries, step_s, LocalSteps(overlap=False), fragments=4)
    assert waiting.tau == 0 and "not overlapped" in waiting.describe()
    short = plan_rounds(SLOW, 2, entries, step_s, LocalSteps(delay=1), fragments=4)  # τ given too short to hide
    assert short.tau == 1 and not short.fits
    assert "a fragment's exchange" in short.describe() and "does not fit in the 100 ms of the 1 steps" in short.describe()
    assert short.per_step_s == pytest.approx(step_s + (short.wire_s - 4 * step_s + short.local_s) / short.every)


def test_local_steps_are_a_row_of_the_table_that_no_per_layer_mode_picks() -> None:
    row = ROWS[Scheme.LOCAL]
    assert row.outer and row.lossy and not row.carrier
    assert Scheme.LOCAL not in AUTO_SCHEMES and Scheme.LOCAL not in COMPRESSED
    for mode in Planned:
        assert Scheme.LOCAL not in mode.allowed(servers=False)
    layer = LayerShape(4 * 1000, ((10, 100),))
    assert Scheme.LOCAL not in estimates(CostContext(SLOW, 2), layer)
    waiting = RoundPlan(10, Codec.INT8, 0.5, 0.01, 2, overlap=False)
    priced = estimates(CostContext(SLOW, 2, rounds=waiting), layer)[Scheme.LOCAL]
    assert priced.seconds == pytest.approx(exchange_seconds(SLOW, 2, 1000, Codec.INT8) / 10)
    hidden = RoundPlan(10, Codec.INT8, 0.05, 0.01, 2)  # 50 ms of wire behind 100 ms of steps: only the codec shows
    priced = estimates(CostContext(SLOW, 2, rounds=hidden), layer)[Scheme.LOCAL]
    assert priced.wire_s == 0.0 and priced.local_s == pytest.approx(exchange_parts(SLOW, 2, 1000, Codec.INT8)[1] / 10)


# ----- auto-far -----


def _train_auto_far(steps: int) -> dict[str, object]:
    hvd.init()
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    far = hvd.LocalSteps(max_every=40)  # rounds short enough to be planned again from measured times in the run
    optimizer = hvd.DistributedOptimizer(inner, model=model, comm="auto-far", local_steps=far)
    x, y = _data(8, steps, seed=hvd.rank())
    for step in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[step]), y[step]).backward()
        optimizer.step()
    optimizer.outer_step()
    outer = rounds_of(optimizer)
    assert outer is not None
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    report = hvd.plan_report(print_table=False)
    plan = outer.plan.describe() if outer.plan is not None else None
    exchange = outer.plan.exchange_s if outer.plan is not None else None
    return {
        "local": outer.plan is not None,
        "rounds": outer.rounds,
        "weights": weights,
        "report": report,
        "plan": plan,
        "exchange": exchange,
    }


@pytest.mark.parametrize("link", ["slow", "shared memory"])
def test_auto_far_takes_local_steps_only_where_the_calibration_says_they_pay(link: str, tmp_path: Any) -> None:
    """The job's calibration is given (the CALIBRATION_FILE knob): a 100 Mbit/s link with 30 ms of latency, or shared
    memory. The first steps run the synchronous plan; then the planner weighs local steps against it."""
    path = tmp_path / "calibration.json"
    path.write_text(calibration_to_json(SLOW if link == "slow" else SHARED_MEMORY))
    env = {"SHOAL_CALIBRATION_FILE": str(path)}
    results = run_ranks(_train_auto_far, 2, args=(160,), env=env, rank_env_overrides=hosts_env([1, 1]), timeout_s=90)
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])  # equal at the end either way
    if link == "slow":
        assert all(r["local"] and r["rounds"] >= 1 for r in results)
        assert "local steps: every" in results[0]["report"] and " local" in results[0]["report"]
        # The report shows the rounds in force, planned again from the loopback's times (without following the
        # re-plans it showed the first plan's, from the calibration: 30.0 ms of exchange against 27.6 measured).
        assert results[0]["plan"] in results[0]["report"]
    else:
        assert not any(r["local"] for r in results) and all(r["rounds"] == 0 for r in results)
        assert "local steps" not in results[0]["report"]


# ----- the elastic sync (TorchState) -----


def _flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _synced_after_a_host_changes(steps: int, newcomer: bool) -> dict[str, object]:
    """Two hosts train with ``auto-far`` (a slow calibration: it takes local steps), then sync as an elastic reset
    does (``TorchState.sync``), with rank 1 either still training (both hosts merge) or replaced by a newcomer (a
    fresh model and optimizer, still weighing), then train on and meet."""
    hvd.init()
    model = _model()
    # Rounds of at most 40 steps: H follows the measured step (0.3 to 1 ms here), and the sync needs two rounds
    # landed before it, whatever the machine's speed.
    far = {"comm": "auto-far", "local_steps": hvd.LocalSteps(max_every=40)}
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **far)
    x, y = _data(8, 2 * steps, seed=hvd.rank())

    def train(begin: int, end: int) -> None:
        for step in range(begin, end):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[step]), y[step]).backward()
            optimizer.step()

    train(0, steps)
    rounds = rounds_of(optimizer)
    assert rounds is not None and rounds.weigh is None and not rounds.disabled  # local steps were chosen
    before = {"start": rounds.start.numpy().copy(), "weights": _flat(model), "every": rounds.plan.every}  # type: ignore[union-attr]
    if newcomer and hvd.rank() == 1:
        torch.manual_seed(99)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **far)
    hvd.elastic.TorchState(model=model, optimizer=optimizer).sync()
    rounds = rounds_of(optimizer)
    assert rounds is not None
    momentum = [t.numpy().copy() for s in rounds.outer.state.values() for t in s.values() if torch.is_tensor(t)]
    after = {
        "weights": _flat(model),
        "start": rounds.start.numpy().copy(),
        "momentum": momentum,
        "local": rounds.weigh is None and not rounds.disabled,
        "every": rounds.plan.every if rounds.plan is not None else None,
        "steps": rounds.steps,
    }
    train(steps, 2 * steps)
    optimizer.outer_step()
    return {"before": before, "after": after, "final": _flat(model)}


@pytest.mark.parametrize("newcomer", [False, True])
def test_the_elastic_sync_merges_the_hosts_progress_and_hands_a_newcomer_the_outer_state(newcomer: bool, tmp_path: Any) -> None:
    """What ``TorchState.sync`` does after a re-form, here without one (the same two ranks): the weights become the
    round's start plus the mean progress of the hosts that were training (numpy reference, within 1e-6), a newcomer
    takes rank 0's outer state (start, momentum, H) and ``auto-far``'s choice, and every host trains on in step with
    the others (equal after the last meeting)."""
    path = tmp_path / "calibration.json"
    path.write_text(calibration_to_json(SLOW))
    env = {"SHOAL_CALIBRATION_FILE": str(path)}
    args = (160, newcomer)
    results = run_ranks(_synced_after_a_host_changes, 2, args=args, env=env, rank_env_overrides=hosts_env([1, 1]), timeout_s=90)
    survivor, other = results[0], results[1]
    start = survivor["before"]["start"]
    trained = [survivor] if newcomer else [survivor, other]
    expected = start + np.mean([r["before"]["weights"] - start for r in trained], axis=0)
    for result in results:
        np.testing.assert_allclose(result["after"]["weights"], expected, atol=1e-6)
        np.testing.assert_array_equal(result["after"]["start"], start)
        assert result["after"]["local"] and result["after"]["every"] == survivor["before"]["every"], result["after"]
    assert len(survivor["after"]["momentum"]) == 4  # the outer optimizer had stepped: momentum for each parameter
    for mine, theirs in zip(survivor["after"]["momentum"], other["after"]["momentum"], strict=True):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_array_equal(survivor["final"], other["final"])


# ----- the benchmark -----

FAR_KEYS = {
    "bench", "hosts", "rate", "task", "far_ips", "sync_ips", "solo_ips", "solo_ips_per_host", "bound_ips", "of_bound",
    "far_bytes_per_sample", "far_round_bytes_per_sample", "sync_bytes_per_sample", "allreduce_bytes_per_sample",
    "far_time_to_target_s",
    "sync_time_to_target_s", "solo_time_to_target_s", "far_eval_loss", "sync_eval_loss", "plan",
}  # fmt: skip


SMALL = {
    "digits": ["--samples", "3000", "--eval-every", "1000", "--width", "64"],
    "chars": ["--task", "chars", "--samples", "3000", "--eval-every", "1000", "--width", "32", "--context", "16"],
}
"""Each task of ``shoal.bench.far``, small: a few seconds per mode."""


@needs_netns
@pytest.mark.timeout(240)
@pytest.mark.parametrize("task", sorted(SMALL))
def test_far_benchmark_json_contract_on_two_emulated_hosts(task: str) -> None:
    """``python -m shoal.bench.netns --hosts 2 --rate 100mbit -- python -m shoal.bench.far`` (and ``--task chars``)
    on a small model and few samples: the JSON line's keys, bytes counted on the hosts' links, the plan's H and
    codec."""
    command = [sys.executable, "-m", "shoal.bench.netns", "--hosts", "2", "--rate", "100mbit", "--"]
    command += [sys.executable, "-m", "shoal.bench.far", *SMALL[task], "--rate", "100mbit"]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split(":", 1)[1] for line in result.stdout.splitlines() if line.startswith("[0]<stdout>:{")]
    data = json.loads(lines[-1])
    assert FAR_KEYS <= set(data) and data["bench"] == "far" and data["hosts"] == 2 and data["rate"] == "100mbit"
    alone = data["solo_ips_per_host"]  # the bound is what both hosts did alone at once
    assert len(alone) == 2 and all(rate > 0 for rate in alone) and alone[0] == pytest.approx(data["solo_ips"], abs=0.1)
    assert data["bound_ips"] == pytest.approx(sum(alone), abs=0.2)
    assert data["of_bound"] == pytest.approx(data["far_ips"] / data["bound_ips"], rel=1e-2)
    # counted on the links, not estimated: local steps send far fewer bytes than uncompressed allreduce would
    assert 0 < data["far_bytes_per_sample"] < data["allreduce_bytes_per_sample"] / 10
    assert 0 < data["far_round_bytes_per_sample"] < data["allreduce_bytes_per_sample"] / 10  # the rounds alone
    assert data["sync_bytes_per_sample"] > data["far_bytes_per_sample"]
    plan = data["plan"]
    assert plan["hosts"] == 2 and plan["codec"] in [codec.value for codec in Codec] and plan["every"] >= 1
    assert 1 <= plan["fragments"] <= 4 and 1 <= plan["delay"] <= plan["every"] and plan["rounds"] >= 1
    chance = math.log(10 if task == "digits" else 256)
    assert data["sync_eval_loss"] < chance and data["far_eval_loss"] < chance  # both learnt something


@needs_netns
@pytest.mark.timeout(240)
def test_the_round_lengthens_within_two_round_ends_when_the_link_slows_down() -> None:
    """``--fault rate:AT:100mbit`` reshapes both hosts' 1 Gbit/s links mid-run (``tc qdisc change``). H then follows
    the measured wire: longer, within two round ends after the first exchange on the slow link."""
    command = [sys.executable, "-m", "shoal.bench.netns", "--hosts", "2", "--rate", "1gbit", "--faults-on-sigusr1"]
    command += ["--fault", "rate:4:100mbit", "--", sys.executable, "-m", "shoal.bench.far", "--modes", "far"]
    command += ["--samples", "120000", "--eval-every", "60000", "--budget", "0.5"]  # the wire sets H, not the round end
    with subprocess.Popen(command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as job:
        assert job.stdout is not None
        lines = []
        for line in job.stdout:  # the fault's clock starts when training does
            lines.append(line)
            if line.startswith("[0]<stdout>:far: training"):
                job.send_signal(signal.SIGUSR1)
                break
        lines += job.stdout.readlines()
        assert job.wait(timeout=200) == 0, "".join(lines[-40:])
    changed = [line for line in lines if "every link's rate: 100mbit begins" in line]
    assert len(changed) == 1, "".join(lines[-40:])
    at = float(changed[0].rsplit("(", 1)[1].strip().rstrip(")"))  # the wall-clock time of the change
    results = [line.split(":", 1)[1] for line in lines if line.startswith("[0]<stdout>:{")]
    plan = json.loads(results[-1])["far"]["plan"]
    ends, replans = plan["round_ends"], plan["replans"]
    before = [every for _, every, when, _ in replans if when < at]
    assert ends[0] < at < ends[-1] and sum(1 for end in ends if end > at) >= 4, (at, ends)  # rounds on both links
    fast_every = before[-1] if before else 20
    first_slow = next(i for i, end in enumerate(ends) if end > at)  # the round end that sends on the slow link
    longer = [(round_, every) for round_, every, when, _ in replans if when > at and every > fast_every]
    assert longer, (at, replans, ends)
    assert longer[0][0] <= first_slow + 1 + 2, (first_slow, longer, replans)  # that exchange's landing, then two


def _train_one_host_behind(steps: int, lag_s: float) -> dict[str, object]:
    """Two hosts of local steps on a fast calibration (H at the floor); host 1 takes ``lag_s`` longer per step."""
    hvd.init()
    model = _model()
    options = hvd.LocalSteps(codec="fp32", fragments=2, wire_share=None)  # the floor of 20
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model=model, comm="local", local_steps=options
    )
    x, y = _data(8, steps, seed=hvd.rank())
    for step in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[step]), y[step]).backward()
        if hvd.rank() == 1:
            time.sleep(lag_s)
        optimizer.step()
    optimizer.outer_step()
    outer = rounds_of(optimizer)
    assert outer is not None and outer.plan is not None
    quiet_after = engine().pauses.quiet_after
    return {
        "replans": outer.replans,
        "every": outer.plan.every,
        "tau": outer.plan.tau,
        "rounds": outer.rounds,
        "quiet": quiet_after,
    }


def test_a_host_running_behind_does_not_lengthen_the_round(tmp_path: Any) -> None:
    """The host ahead sees each exchange end only once the host behind has sent its part: its wire holds the hosts'
    skew, which waiting at the landings keeps to about τ steps. Re-planning takes the shortest wire a sending rank
    saw (the link's own time), so H stays near the floor and τ short. Taking the skew as wire lengthened both every
    round (H 37, 40, 92 and τ 46 after 5 rounds with 4 ms of lag), and a longer τ let the host behind fall further
    behind."""
    path = tmp_path / "calibration.json"
    path.write_text(calibration_to_json(SHARED_MEMORY))
    env = {"SHOAL_CALIBRATION_FILE": str(path)}
    args = (200, 0.01)  # 10 ms more per step on host 1: 200 ms of skew per round of 20 steps, were it not waited for
    results = run_ranks(_train_one_host_behind, 2, args=args, env=env, rank_env_overrides=hosts_env([1, 1]), timeout_s=90)
    for result in results:
        # The loopback's own time moves H a little on a busy machine (to 43 with 4 ms of lag, in a parallel run of
        # the suite); a longer lag makes each step longer against that time, and the skew longer still.
        assert result["rounds"] >= 5, result
        assert result["every"] <= 40 and all(every <= 40 for _, every, *_ in result["replans"]), result
        assert result["tau"] <= 15, result  # at least H / 2 (two fragments), and the wire's few steps
        assert result["quiet"] == QUIET_AFTER  # hosts of one rank: the engines back off sooner between exchanges


# ----- errors -----


def _bad_arguments() -> list[str]:
    hvd.init()
    model = nn.Linear(3, 2)
    errors = []
    for kwargs in (
        {"every": 5},  # with comm="allreduce"
        {"comm": "local", "op": hvd.Sum},
        {"comm": "local", "every": 0},
        {"comm": "local", "local_steps": hvd.LocalSteps(every=2), "compression": hvd.Compression.powersgd(rank=2)},
    ):
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_local_steps_refuse_what_they_cannot_honour() -> None:
    errors = run_ranks(_bad_arguments, 1, timeout_s=60)[0]
    assert len(errors) == 4
    assert "go with comm='local'" in errors[0]
    assert "op=Average" in errors[1]
    assert "every must be an int >= 1" in errors[2]
    assert "cannot go with comm='local'" in errors[3]
    with pytest.raises(ValueError, match="codec must be one of"):
        LocalSteps(codec="int2")
    with pytest.raises(ValueError, match="fragments must be an int >= 1"):
        LocalSteps(fragments=0)
    with pytest.raises(ValueError, match="delay must be an int >= 1"):
        LocalSteps(delay=0)
    with pytest.raises(ValueError, match="delay needs overlap=True"):
        LocalSteps(delay=3, overlap=False)
