"""The drift monitor: running measured times per layer, and when it asks for a recalibration."""

from __future__ import annotations

import pytest

from shoal.plan.calibration import Calibration, calibration_from_json, calibration_to_json
from shoal.plan.drift import DriftConfig, DriftMonitor, refit
from shoal.plan.planner import LayerPlan


def plans(predicted_ms: float) -> list[LayerPlan]:
    return [LayerPlan(f"fc{i}", "Linear", (4, 4), 64, 8, predicted_ms={"allreduce": predicted_ms}) for i in range(3)]


CALIBRATION = Calibration.uniform(0.010, 0.0, 1e10)
"""Every collective takes 10 ms, whatever its size."""
NO_WARMUP = DriftConfig(warmup_steps=0)
"""Count from a plan's first step (the warm-up has a test of its own)."""


def step(monitor: DriftMonitor, execution: tuple[float, int, int] | None) -> float | None:
    """One step whose every exchange ran as ``execution``, agreed at once (a single rank: its own times)."""
    monitor.record_step(lambda name: execution)
    return monitor.agree(monitor.pending())


def run_steps(monitor: DriftMonitor, seconds: float, count: int) -> list[float | None]:
    """``count`` steps in which each layer's weight and bias (8 elements each) go in one collective of ``seconds``."""
    return [step(monitor, (seconds / 2, 8, 16)) for _ in range(count)]


def test_accurate_predictions_never_drift_and_fill_measured_ms() -> None:
    layer_plans = plans(predicted_ms=10.0)
    monitor = DriftMonitor(
        layer_plans, {p.name: [f"{p.name}.weight", f"{p.name}.bias"] for p in layer_plans}, CALIBRATION, NO_WARMUP
    )
    errors = run_steps(monitor, 0.0105, 20)
    assert all(e is not None and e < 0.1 for e in errors)
    assert not monitor.drifted()
    assert layer_plans[0].measured_ms == pytest.approx(10.5) and layer_plans[0].expected_ms == pytest.approx(10.0)


def test_a_layer_fused_with_others_is_expected_to_pay_its_share_of_one_latency() -> None:
    layer_plans = plans(predicted_ms=10.0)
    monitor = DriftMonitor(layer_plans, {p.name: [p.name] for p in layer_plans}, CALIBRATION, NO_WARMUP)
    step(monitor, (0.0025, 4, 16))  # a quarter of a fused 10 ms collective
    assert layer_plans[0].expected_ms == pytest.approx(2.5) and layer_plans[0].measured_ms == pytest.approx(2.5)


def test_sustained_drift_is_reported_after_the_configured_steps_then_backs_off() -> None:
    layer_plans = plans(predicted_ms=10.0)
    names = {p.name: [p.name, p.name + ".bias"] for p in layer_plans}
    monitor = DriftMonitor(layer_plans, names, CALIBRATION, DriftConfig(steps=5, first_backoff_steps=20, warmup_steps=0))
    run_steps(monitor, 0.040, 4)
    assert not monitor.drifted()  # 4 steps of drift are not yet "several"
    run_steps(monitor, 0.040, 1)
    assert monitor.drifted() and monitor.check_due()
    monitor.replan(plans(predicted_ms=10.0), names, CALIBRATION)  # say the new plan is still wrong
    run_steps(monitor, 0.040, 10)
    assert not monitor.drifted()  # backing off for 20 steps
    run_steps(monitor, 0.040, 10)
    assert monitor.drifted() and monitor.recalibrations == 1


def test_one_noisy_step_neither_starts_nor_breaks_a_drift() -> None:
    layer_plans = plans(predicted_ms=10.0)
    names = {p.name: [p.name, p.name + ".bias"] for p in layer_plans}
    monitor = DriftMonitor(layer_plans, names, CALIBRATION, DriftConfig(steps=3, first_backoff_steps=0, warmup_steps=0))
    run_steps(monitor, 0.010, 3)
    run_steps(monitor, 0.040, 1)  # a single slow step: the running median stays on the prediction
    assert not monitor.drifted()
    run_steps(monitor, 0.040, 3)  # now most of the window is slow: drifting for 3 steps
    run_steps(monitor, 0.010, 1)  # one fast step does not break it
    assert monitor.drifted()
    run_steps(monitor, 0.010, 6)  # back to the prediction for good
    assert not monitor.drifted()


def test_layers_without_engine_exchanges_are_skipped() -> None:
    monitor = DriftMonitor(plans(10.0), {"fc0": ["fc0"]}, CALIBRATION, NO_WARMUP)
    assert step(monitor, None) is None
    assert [p.name for p in monitor.plans] == ["fc0"]


def test_a_small_measured_share_of_the_plan_never_drifts() -> None:
    # Two large PowerSGD layers have no engine exchange to measure; the one small allreduce layer measuring 10x its
    # prediction (queued behind their traffic) is not evidence that the network changed.
    layer_plans = [
        LayerPlan("fc0", "Linear", (2048, 3072), 25_000_000, 32, predicted_ms={"powersgd": 40.0}, choice="powersgd"),
        LayerPlan("fc1", "Linear", (1536, 2048), 12_500_000, 32, predicted_ms={"powersgd": 30.0}, choice="powersgd"),
        LayerPlan("fc2", "Linear", (10, 1536), 61_000, 32, predicted_ms={"allreduce": 10.0}),
    ]
    config = DriftConfig(steps=2, first_backoff_steps=0, warmup_steps=0)
    monitor = DriftMonitor(layer_plans, {"fc2": ["fc2"]}, CALIBRATION, config)
    assert [step(monitor, (0.100, 8, 8)) for _ in range(4)] == [None] * 4
    assert not monitor.drifted() and layer_plans[2].measured_ms == pytest.approx(100.0)
    # The same layer carrying the plan's time does drift.
    layer_plans[0].predicted_ms["powersgd"] = layer_plans[1].predicted_ms["powersgd"] = 5.0
    monitor = DriftMonitor(layer_plans, {"fc2": ["fc2"]}, CALIBRATION, config)
    assert [step(monitor, (0.100, 8, 8)) for _ in range(2)] == [pytest.approx(0.9)] * 2
    assert monitor.drifted()


def test_calibration_file_round_trip_and_errors() -> None:
    calibration = Calibration.uniform(1e-4, 1e-9, 1e10)
    assert calibration_from_json(calibration_to_json(calibration), "x") == calibration
    with pytest.raises(ValueError, match="not a Shoal calibration file"):
        calibration_from_json("{}", "cal.json")
    with pytest.raises(ValueError, match="lacks the exchanges"):
        calibration_from_json('{"lines": {"allreduce": [0, 0]}, "flops_per_s": 1}', "cal.json")


def test_refit_recovers_a_line_from_layers_of_different_sizes() -> None:
    truth = (0.002, 0.5e-9)  # 2 ms latency, 2 GB/s
    layer_plans = [
        LayerPlan(f"l{i}", "Linear", (1,), n, None, predicted_ms={"allreduce": 1.0})
        for i, n in enumerate((64_000, 1_000_000, 25_000_000))
    ]
    terms = {p.name: (1.0, float(p.nbytes)) for p in layer_plans}  # each layer alone in its collective
    for plan in layer_plans:
        plan.measured_ms = (truth[0] + truth[1] * plan.nbytes) * 1e3
        plan.expected_ms = 1.0
    fitted = refit(Calibration.uniform(0.1, 1e-9, 1e10), layer_plans, terms)
    assert fitted.lines["allreduce"] == pytest.approx(truth, rel=1e-6)
    # Exchanges without measurements take allreduce's changes: α by its α's ratio, β by its β's.
    assert fitted.lines["allgather"] == pytest.approx((0.1 * truth[0] / 0.1, 1e-9 * truth[1] / 1e-9))
    assert fitted.lines["fp16"] == pytest.approx((0.1 * truth[0] / 0.1, 0.5e-9 * truth[1] / 1e-9))


def test_refit_scales_when_sizes_cannot_separate_latency_from_bandwidth() -> None:
    layer_plans = plans(predicted_ms=10.0)
    for plan in layer_plans:
        plan.measured_ms, plan.expected_ms = 20.0, 10.0
    terms = {p.name: (1.0, 64.0) for p in layer_plans}  # identical layers
    fitted = refit(CALIBRATION, layer_plans, terms)
    assert fitted.lines["allreduce"] == pytest.approx((0.020, 0.0))
    assert fitted.lines["fp16"] == pytest.approx((0.020, 0.0))  # twice the latency, like allreduce's


def test_a_refit_carries_latency_and_bandwidth_changes_separately_to_unmeasured_schemes() -> None:
    calibration = Calibration.uniform(0.001, 1e-9, 1e10)  # fp16 moves half the bytes at the same latency
    sizes = (64_000, 12_000_000, 25_000_000)
    layer_plans = [
        LayerPlan(f"l{i}", "Linear", (1,), n, None, predicted_ms={"allreduce": calibration.seconds("allreduce", n) * 1e3})
        for i, n in enumerate(sizes)
    ]
    for plan in layer_plans:  # training is slower than calibration: 3x the latency, 1.5x the time per byte
        plan.measured_ms = (0.003 + 1.5e-9 * plan.nbytes) * 1e3
    fitted = refit(calibration, layer_plans, {p.name: (1.0, float(p.nbytes)) for p in layer_plans})
    assert fitted.lines["allreduce"] == pytest.approx((0.003, 1.5e-9))
    assert fitted.lines["fp16"] == pytest.approx((0.003, 0.75e-9))
    for n in sizes:  # busier cores, not a slower link: fp16 gains nothing on allreduce
        assert fitted.seconds("fp16", n) / fitted.seconds("allreduce", n) >= calibration.seconds(
            "fp16", n
        ) / calibration.seconds("allreduce", n)


def test_the_ranks_agreed_times_are_what_counts() -> None:
    layer_plans = plans(predicted_ms=10.0)
    names = {p.name: [p.name] for p in layer_plans}
    config = DriftConfig(steps=2, first_backoff_steps=0, warmup_steps=0)
    monitor = DriftMonitor(layer_plans, names, CALIBRATION, config)
    slow_rank = DriftMonitor(plans(predicted_ms=10.0), names, CALIBRATION, config)
    for _ in range(2):
        monitor.record_step(lambda name: (0.010, 16, 16))
        slow_rank.record_step(lambda name: (0.040, 16, 16))  # waited 30 ms for its peer to enter each collective
    assert monitor.pending() == [0.010] * 6 and slow_rank.pending() == [0.040] * 6
    agreed = [min(pair) for pair in zip(monitor.pending(), slow_rank.pending(), strict=True)]  # what MIN gives
    assert monitor.agree(agreed) == pytest.approx(0.0) and slow_rank.agree(agreed) == pytest.approx(0.0)
    assert layer_plans[0].measured_ms == pytest.approx(10.0)
    assert monitor.pending() == []  # counted once
    monitor.record_step(lambda name: (0.010, 16, 16))
    with pytest.raises(ValueError, match="needs 3 values"):
        monitor.agree([0.010])


def test_a_layer_measured_on_a_mix_of_fused_and_lone_steps_is_compared_over_the_same_mix() -> None:
    layer_plans = plans(predicted_ms=10.0)
    monitor = DriftMonitor(layer_plans, {p.name: [p.name] for p in layer_plans}, CALIBRATION, NO_WARMUP)
    for _ in range(4):
        step(monitor, (0.0025, 4, 16))  # fused: a quarter of one 10 ms collective
        step(monitor, (0.010, 16, 16))  # alone: a whole one
    step(monitor, (0.010, 16, 16))
    # 5 of the last 9 steps ran alone: both medians are those of the lone steps, whatever the last step was.
    assert layer_plans[0].measured_ms == pytest.approx(10.0) and layer_plans[0].expected_ms == pytest.approx(10.0)
    step(monitor, (0.0025, 4, 16))
    step(monitor, (0.0025, 4, 16))
    assert layer_plans[0].measured_ms == pytest.approx(2.5) and layer_plans[0].expected_ms == pytest.approx(2.5)


def test_refit_takes_the_matmul_rate_from_measured_sfb_rebuilds() -> None:
    calibration = Calibration.uniform(0.001, 1e-9, 1e10)
    layer = LayerPlan("fc", "Linear", (2048, 3072), 25_174_016, 32, predicted_ms={}, choice="sfb", rebuild_flops=8e8)
    allgathers_s = 0.004
    layer.predicted_ms["sfb"] = (allgathers_s + 8e8 / 1e10) * 1e3  # 4 ms of allgathers + 80 ms of rebuild
    layer.measured_ms = (2 * allgathers_s + 0.040) * 1e3  # the matmul ran at 2e10 flop/s, the allgathers took 8 ms
    fitted = refit(calibration, [layer], {}, {"fc": 0.040})
    assert fitted.flops_per_s == pytest.approx(2e10)
    assert fitted.lines["allgather"] == pytest.approx((0.002, 2e-9))  # twice as slow as calibrated


def test_a_plans_first_steps_are_not_counted() -> None:
    layer_plans = plans(predicted_ms=10.0)
    names = {p.name: [p.name] for p in layer_plans}
    monitor = DriftMonitor(layer_plans, names, CALIBRATION, DriftConfig(steps=2, first_backoff_steps=0, warmup_steps=3))
    for _ in range(3):  # one-off costs of a fresh plan: four times the steady time
        monitor.record_step(lambda name: (0.040, 16, 16))
        assert monitor.pending() == [] and not monitor.check_due()
    assert layer_plans[0].measured_ms is None
    monitor.record_step(lambda name: (0.010, 16, 16))
    assert monitor.check_due()  # step 4: the ranks agree on step 4 alone
    assert monitor.agree(monitor.pending()) == pytest.approx(0.0)
    assert layer_plans[0].measured_ms == pytest.approx(10.0)
    fresh = plans(predicted_ms=10.0)
    monitor.replan(fresh, names, CALIBRATION)  # a new plan warms up again
    for _ in range(3):
        monitor.record_step(lambda name: (0.040, 16, 16))
    assert monitor.pending() == [] and fresh[0].measured_ms is None


def test_a_steady_network_does_not_flip_a_plan_whose_predictions_are_far_apart() -> None:
    """The 1 Gbit/s MLP: SFB about 4× cheaper than fp16 for the two big layers, fp16 for the head.

    Training then measures the SFB layers' allgathers 3.6× above their probes (backprop competes for the cores), the
    rebuild at a third of the probed matmul rate, and the head's fp16 exchange as predicted: slower everywhere,
    nothing that makes fp16 cheaper than SFB. A refit from one layer's ratio per exchange once read that as "bf16's
    line is fine, the allgather line is 3.6× worse" and re-planned fp16 for the big layers, 23% slower.
    """
    from torch import nn

    from shoal.torch.layer_comm.layers import build_plan

    model = nn.Sequential(nn.Flatten(), nn.Linear(3072, 2048), nn.ReLU(), nn.Linear(2048, 1536), nn.ReLU(), nn.Linear(1536, 10))
    half = (0.0016, 4.2e-9)
    probed = Calibration(
        {"allreduce": (0.0016, 8.3e-9), "fp16": half, "bf16": half, "allgather": (0.0016, 8.3e-9)}, flops_per_s=7.6e10
    )
    rows = {"1": 32, "3": 32, "5": 32}
    layer_plans = build_plan(model, probed, 2, rows)
    assert [p.choice for p in layer_plans] == ["sfb", "sfb", "fp16"]
    rebuilds = {}
    for plan in layer_plans:
        if plan.choice == "sfb":
            assert plan.rebuild_flops is not None
            rebuilds[plan.name] = 3 * plan.rebuild_flops / probed.flops_per_s
            allgathers_ms = plan.predicted_ms["sfb"] - plan.rebuild_flops / probed.flops_per_s * 1e3
            plan.measured_ms = 3.6 * allgathers_ms + rebuilds[plan.name] * 1e3
        else:
            plan.measured_ms = plan.predicted_ms[plan.choice]
    terms = {p.name: (1.0, float(p.nbytes)) for p in layer_plans if p.choice != "sfb"}
    fitted = refit(probed, layer_plans, terms, rebuilds)
    assert fitted.flops_per_s == pytest.approx(probed.flops_per_s / 3)
    assert fitted.lines["fp16"][1] / half[1] == pytest.approx(3.6)  # the job-wide slow-down, not the head's alone
    assert [p.choice for p in build_plan(model, fitted, 2, rows)] == ["sfb", "sfb", "fp16"]


def test_two_layers_only_twice_apart_are_scaled_not_fitted() -> None:
    """The one-host MLP: allreduce measured 12.0 ms on its 25 MB layer and 11.9 ms on its 12.6 MB one (both mostly
    waiting). A least-squares line through two such points puts nearly everything in α (β near 0), which leaves
    every line latency-only and made fp16, whose probed α is 0.07 ms below allreduce's, the choice for every layer;
    scaling by the median ratio keeps the lines' shape."""
    probed = Calibration(
        {"allreduce": (4.0e-4, 1.45e-10), "fp16": (3.3e-4, 4.6e-10), "bf16": (3.5e-4, 5.1e-10), "allgather": (9e-4, 2e-9)},
        1e11,
    )
    layer_plans = []
    for name, nbytes, measured_ms in (("fc1", 25_174_016, 12.0), ("fc2", 12_589_056, 11.9)):
        predicted = probed.seconds("allreduce", nbytes) * 1e3
        plan = LayerPlan(name, "Linear", (1,), nbytes, 32, predicted_ms={"allreduce": predicted})
        plan.measured_ms = measured_ms
        layer_plans.append(plan)
    fitted = refit(probed, layer_plans, {p.name: (1.0, float(p.nbytes)) for p in layer_plans})
    factor = (12.0 / layer_plans[0].predicted_ms["allreduce"] + 11.9 / layer_plans[1].predicted_ms["allreduce"]) / 2
    assert fitted.lines["allreduce"] == pytest.approx((4.0e-4 * factor, 1.45e-10 * factor))
    assert fitted.lines["fp16"] == pytest.approx((3.3e-4 * factor, 4.6e-10 * factor))
    for nbytes in (25_174_016, 12_589_056):
        assert fitted.seconds("allreduce", nbytes) < fitted.seconds("fp16", nbytes)


def test_a_re_plan_keeps_a_scheme_that_measured_cheaper_than_the_alternative_is_predicted() -> None:
    from shoal.plan.planner import keep_measured

    def layer(choice: str, predicted: dict[str, float], measured: float | None = None) -> LayerPlan:
        plan = LayerPlan("fc", "Linear", (2048, 3072), 25_174_016, 32, predicted_ms=predicted, choice=choice)
        plan.measured_ms = measured
        return plan

    before = [layer("sfb", {"sfb": 24.0, "fp16": 105.0}, measured=90.0)]  # SFB ran at 90 ms in training
    misjudged = [layer("fp16", {"sfb": 160.0, "fp16": 120.0})]  # a refit that now predicts fp16 at 120 ms
    assert keep_measured(misjudged, before) == ["fc"] and misjudged[0].choice == "sfb"
    really_better = [layer("fp16", {"sfb": 160.0, "fp16": 60.0})]  # predicted below what SFB measured
    assert keep_measured(really_better, before) == [] and really_better[0].choice == "fp16"
    unmeasured = [layer("fp16", {"sfb": 160.0, "fp16": 120.0})]
    assert keep_measured(unmeasured, [layer("sfb", {"sfb": 24.0})]) == [] and unmeasured[0].choice == "fp16"


def test_probing_stops_where_the_fitted_line_says_the_next_size_is_too_slow_not_the_scaled_last_time() -> None:
    """``too_slow`` predicts the next probe size from a line through the times so far. Two latency-bound times on
    loopback (13.4 and 21.1 ms at 4 and 32 KiB, a cycle's round trip to the other host on a loaded machine) do not
    stop the probing; scaled by the bytes, the 32 KiB time predicted 169 ms for 256 KiB and stopped it, and loopback
    was fitted at 0.00 GB/s. Slow links still stop early: at 10 Mbit/s 32 KiB takes about 26 ms more than 4 KiB."""
    from shoal.torch.layer_comm.calibrate import _PROBE_BUDGET_S, _PROBE_BYTES, too_slow

    assert _PROBE_BYTES[:3] == (4096, 32768, 262144)
    assert 21.07e-3 * _PROBE_BYTES[2] / _PROBE_BYTES[1] > 2 * _PROBE_BUDGET_S  # what the scaled rule did
    assert not too_slow([13.4e-3, 21.07e-3], _PROBE_BYTES[2])
    assert too_slow([8e-3, 34e-3], _PROBE_BYTES[2])  # 10 Mbit/s: about 245 ms predicted for 256 KiB
    assert too_slow([1e-3, 4e-3, 23e-3], _PROBE_BYTES[3])  # 100 Mbit/s: 2 MiB would take about 170 ms
    assert not too_slow([5.16e-3, 5.08e-3, 8.14e-3, 13.41e-3], _PROBE_BYTES[4])  # loopback: 8 MiB in about 40 ms


def _scout(sleep_on_rank_1: float) -> float:
    import time

    import shoal.torch as hvd
    from shoal.torch.layer_comm.calibrate import _scout_seconds

    hvd.init()
    pause = sleep_on_rank_1 if hvd.rank() == 1 else 0.0
    return _scout_seconds({"allreduce": (lambda: time.sleep(pause), 1.0), "other": (lambda: 1 / 0, 1.0)}, "scout")


def test_a_scout_call_times_the_first_probe_once_and_every_rank_takes_the_slowest() -> None:
    """Where the line lets a size through, one call of its first probe decides first (a rate limit's burst hides the
    link's rate from the small sizes); every rank gets the slowest rank's time, so all stop at the same size."""
    from shoal.testing import run_ranks

    scouted = run_ranks(_scout, 2, args=(0.2,), timeout_s=60)
    assert all(seconds >= 0.2 for seconds in scouted) and scouted[0] == scouted[1]
