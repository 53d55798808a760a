"""The step simulator behind ``python -m shoal.predict``, on cases whose answers are known, and its command line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from shoal.plan.calibration import Calibration, calibration_to_json
from shoal.plan.far import LocalSteps, plan_rounds
from shoal.plan.planner import predict
from shoal.plan.schemes import Scheme
from shoal.plan.simulate import Gradient, Layer, Line, Links, StepProfile, simulate
from shoal.predict import scaling
from shoal.predict.profile import flop_profile

MB = 1_000_000
LINKS = Links(inter=Line(1e-4, 1e-8), intra=Line(2e-5, 1e-10), cast_per_byte_s=1e-10, flops_per_s=1e11)
"""100 µs a message and 100 MB/s between hosts; shared memory within one."""


def profile(gradients: list[tuple[str, int, float]], forward: float = 0.01, backward: float = 0.05) -> StepProfile:
    """A step whose gradients (layer, bytes, ready) are each their own non-linear layer."""
    layers = [Layer(name, "Conv2d", nbytes) for name, nbytes, _ in gradients]
    return StepProfile(forward, backward, 0.005, 32, [Gradient(*g) for g in gradients], layers)


def ring_seconds(nbytes: float, hosts: int, line: Line = LINKS.inter) -> float:  # type: ignore[assignment]
    return 2 * (hosts - 1) * line.latency_s + 2 * (hosts - 1) / hosts * nbytes * line.per_byte_s


def test_no_overlap_possible_when_every_gradient_is_ready_at_the_end() -> None:
    step = profile([("a", 3 * MB, 0.05), ("b", 3 * MB, 0.05)])  # both final when backward ends
    result = simulate(step, LINKS, workers=4, comm="allreduce")
    comm = ring_seconds(3 * MB, 4) * 2  # two full buckets, one after the other
    assert result.step_s == pytest.approx(step.compute_s + comm)
    assert result.exposed_comm_s == pytest.approx(comm)
    assert result.efficiency == pytest.approx(step.compute_s / (step.compute_s + comm))


def test_communication_entirely_hidden_under_backward() -> None:
    step = profile([("a", 3 * MB, 0.001), ("b", 3 * MB, 0.002)], backward=0.5)  # ~45 ms each, 0.5 s of backward
    result = simulate(step, LINKS, workers=2, comm="allreduce")
    assert result.comm_s > 0.05
    assert result.step_s == pytest.approx(step.compute_s) and result.efficiency == pytest.approx(1.0)


def test_one_layer_waits_from_its_ready_time() -> None:
    step = profile([("only", 4 * MB, 0.03)])
    result = simulate(step, LINKS, workers=2, comm="allreduce")
    assert result.step_s == pytest.approx(0.01 + 0.03 + ring_seconds(4 * MB, 2) + 0.005)


def test_small_gradients_wait_in_their_bucket_until_backward_ends() -> None:
    step = profile([("a", 1000, 0.001), ("b", 1000, 0.002)], backward=0.2)
    result = simulate(step, LINKS, workers=2, comm="allreduce")
    assert len(result.exchanges) == 1 and result.exchanges[0].submitted_s == pytest.approx(0.2)
    assert result.step_s == pytest.approx(step.compute_s + ring_seconds(2000, 2))


def test_one_worker_has_no_communication() -> None:
    step = profile([("a", 3 * MB, 0.05)])
    result = simulate(step, LINKS, workers=1)
    assert result.exchanges == [] and result.step_s == pytest.approx(step.compute_s) and result.efficiency == 1.0


def test_hierarchical_and_ring_lines() -> None:
    one_per_host = LINKS.calibration(8, 1)
    assert one_per_host.lines["allreduce"] == pytest.approx((14 * 1e-4, 14 / 8 * 1e-8))
    assert one_per_host.lines["allgather"] == pytest.approx((7 * 1e-4, 7 / 8 * 1e-8))
    four_per_host = LINKS.calibration(8, 4)  # 2 hosts: shared memory, then a ring of two
    assert four_per_host.lines["allreduce"] == pytest.approx((2e-5 + 2e-4, 1e-10 + 1e-8))
    assert four_per_host.lines["fp16"][1] == pytest.approx((1e-10 + 1e-8) / 2 + 1e-10)
    assert set(four_per_host.links) == {"intra-host", "inter-host"}
    assert LINKS.calibration(4, 4).lines["allreduce"] == pytest.approx((2e-5, 1e-10))  # one host


def test_a_calibration_carries_to_its_own_worker_count_unchanged() -> None:
    measured = Calibration(
        {"allreduce": (2e-3, 1.2e-8), "fp16": (2e-3, 0.7e-8), "bf16": (2e-3, 0.7e-8), "allgather": (1e-3, 0.8e-8)}, 5e10
    )
    links = Links.from_calibration(measured, workers=3, hosts=3)
    again = links.calibration(3, 1)
    assert again.lines["allreduce"] == pytest.approx(measured.lines["allreduce"])
    assert again.lines["fp16"] == pytest.approx(measured.lines["fp16"])
    assert links.cast_per_byte_s == pytest.approx(0.1e-8)
    with pytest.raises(ValueError, match="link between hosts"):
        Links.from_calibration(measured, workers=2, hosts=1).calibration(4, 2)
    with pytest.raises(ValueError, match="intra-host and inter-host"):
        Links.from_calibration(measured, workers=4, hosts=2)


def test_auto_takes_the_planners_choice_and_sfb_rebuilds_at_synchronize() -> None:
    rows, outputs, inputs = 32, 2048, 3072
    nbytes = 4 * (outputs * inputs + outputs)
    layer = Layer("fc", "Linear", nbytes, (rows, outputs, inputs))
    step = StepProfile(0.01, 0.05, 0.005, 32, [Gradient("fc", nbytes, 0.02)], [layer])
    result = simulate(step, LINKS, workers=2, comm="auto")
    calibration = LINKS.calibration(2, 1)
    predictions = predict(calibration, 2, nbytes, (rows, outputs, inputs))
    assert result.choices["fc"] == min(predictions, key=predictions.__getitem__) == Scheme.SFB
    rebuild = 2 * 2 * rows * outputs * inputs / LINKS.flops_per_s
    early = calibration.seconds("allgather", 2 * rows * inputs * 4)  # the inputs' allgather, sent at forward
    wire = predictions[Scheme.SFB] - rebuild - early  # the output gradients', sent when the gradient is ready
    first, second = result.exchanges
    assert (first.submitted_s, first.seconds) == pytest.approx((0.0, early))
    assert (second.submitted_s, second.seconds) == pytest.approx((0.02, wire))
    end = max(0.02, early) + wire
    assert result.step_s == pytest.approx(0.01 + max(0.05, end) + rebuild + 0.005)


def test_sfb_with_a_bias_spares_backward_the_local_weight_gradient() -> None:
    """SFB leaves autograd's local weight gradient out (the layer has a trainable bias): the planner's prediction
    drops by 2·K·M·N flops, and the simulated backward ends that much earlier, with later gradients ready earlier."""
    rows, outputs, inputs = 32, 2048, 3072
    nbytes = 4 * (outputs * inputs + outputs)
    calibration = LINKS.calibration(2, 1)
    plain = predict(calibration, 2, nbytes, (rows, outputs, inputs))
    spared = 2 * rows * outputs * inputs / LINKS.flops_per_s
    sparing = predict(calibration, 2, nbytes, (rows, outputs, inputs), spares_local=True)
    assert sparing[Scheme.SFB] == pytest.approx(plain[Scheme.SFB] - spared) and sparing[Scheme.FP16] == plain[Scheme.FP16]
    gradients = [Gradient("fc", nbytes, 0.02), Gradient("conv", 4000, 0.04)]
    layers = [Layer("fc", "Linear", nbytes, (rows, outputs, inputs), spares_local=True), Layer("conv", "Conv2d", 4000)]
    step = StepProfile(0.01, 0.05, 0.005, 32, gradients, layers)
    result = simulate(step, LINKS, workers=2, comm="auto")
    assert result.choices["fc"] == Scheme.SFB
    rebuild = 2 * 2 * rows * outputs * inputs / LINKS.flops_per_s
    early = calibration.seconds("allgather", 2 * rows * inputs * 4)
    wire = plain[Scheme.SFB] - rebuild - early
    _, sfb, bucket = sorted(result.exchanges, key=lambda e: (e.scheme != Scheme.SFB, e.submitted_s))
    assert sfb.submitted_s == pytest.approx(0.02 - spared) and sfb.seconds == pytest.approx(wire)
    assert bucket.submitted_s == pytest.approx(0.05 - spared)  # flushed when the shorter backward ends
    assert bucket.start_s == pytest.approx(max(bucket.submitted_s, sfb.end_s))
    end = max(0.05 - spared, sfb.end_s, bucket.end_s)
    assert result.step_s == pytest.approx(0.01 + end + rebuild + 0.005)


def test_scaling_names_the_bottleneck_and_the_better_setting() -> None:
    rows, outputs, inputs = 32, 2048, 3072
    nbytes = 4 * (outputs * inputs + outputs)
    step = StepProfile(
        0.01, 0.05, 0.005, 32, [Gradient("fc", nbytes, 0.05)], [Layer("fc", "Linear", nbytes, (rows, outputs, inputs))]
    )
    row = scaling(step, LINKS, [8], comm="allreduce")[0]
    assert row.best_comm == "sfb" or row.best_comm == "auto"
    assert row.best_efficiency > row.prediction.efficiency
    assert "communication-bound" in row.advice() and "fc" in row.advice() and f"comm={row.best_comm}" in row.advice()


def test_local_steps_are_played_as_inner_steps_plus_the_rounds_exposed_exchange() -> None:
    """``local``: the step among one host's ranks, plus the outer exchange's exposed wire and codec work over H (the
    ``RoundPlan`` that ``plan_rounds`` makes for that step); ``auto-far`` takes it where ``prefer_local`` does."""
    step = profile([("fc2", 8 * MB, 0.02), ("fc1", 8 * MB, 0.05)])
    slow = Links(inter=Line(30e-3, 8e-8), intra=LINKS.intra, cast_per_byte_s=1e-10, flops_per_s=1e11)  # 100 Mbit/s
    synchronous = simulate(step, slow, 2, 1, "allreduce")
    local = simulate(step, slow, 2, 1, "local")
    alone = simulate(step, slow, 1, 1, "allreduce")
    rounds = plan_rounds(slow.calibration(2, 1), 2, 4 * MB, alone.step_s, LocalSteps(), fragments=2)
    assert local.step_s == pytest.approx(rounds.per_step_s) and rounds.every > 1
    assert set(local.choices.values()) == {Scheme.LOCAL}
    assert local.efficiency > 0.9 > synchronous.efficiency  # 16 MB at 100 Mbit/s each step, against once a round
    busy = simulate(step, slow, 2, 1, "local", cpu_bound=True)  # the wire's busy part cannot run beside compute
    assert busy.step_s == pytest.approx(local.step_s + rounds.wire_s / rounds.every)  # all of it: no share measured
    far = simulate(step, slow, 2, 1, "auto-far")
    assert far.step_s == pytest.approx(local.step_s) and set(far.choices.values()) == {Scheme.LOCAL}
    one_host = simulate(step, slow, 4, 4, "auto-far")  # shared memory: auto-lossy's plan, not local steps
    assert Scheme.LOCAL not in one_host.choices.values()
    assert one_host.step_s == pytest.approx(simulate(step, slow, 4, 4, "auto-lossy").step_s)
    in_host = simulate(step, slow, 4, 4, "local")  # one host: its ranks are synchronous, nothing crosses hosts
    assert in_host.step_s == pytest.approx(simulate(step, slow, 4, 4, "allreduce").step_s)
    row = scaling(step, slow, [2], comm="allreduce")[0]  # the advice ranks synchronous settings, and names local steps
    assert row.best_comm not in ("local", "auto-far") and row.far_efficiency == pytest.approx(local.efficiency)
    assert "local steps (comm=local or auto-far) would reach" in row.advice() and "changes the optimization" in row.advice()
    assert row.as_dict()["far_efficiency"] == round(local.efficiency, 3)


def test_flop_profile_orders_gradients_backwards_and_counts_linear_flops() -> None:
    profile_ = flop_profile("mlp", 8, device_flops=1e12)
    forward_flops = 2 * 8 * (3072 * 2048 + 2048 * 1536 + 1536 * 10)
    assert profile_.forward_s == pytest.approx(forward_flops / 1e12, rel=0.01)
    ready = {g.layer: g.ready_s for g in profile_.gradients}
    assert ready["5"] < ready["3"] < ready["1"] == pytest.approx(profile_.backward_s, rel=0.01)
    assert {layer.name: layer.linear for layer in profile_.layers}["1"] == (8, 2048, 3072)


def tiny_model() -> tuple[nn.Module, object]:
    """A user factory for ``--model test_predict:tiny_model``."""
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2)), lambda n, g: torch.randn(n, 16, generator=g)


@pytest.mark.timeout(120)
def test_command_line_prints_a_row_per_worker_count_and_a_json_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from shoal.predict.__main__ import main

    monkeypatch.syspath_prepend(os.path.dirname(__file__))

    png = tmp_path / "scaling.png"
    main(["--model", "test_predict:tiny_model", "--workers", "1,2,4", "--link", "10gbit", "--steps", "3", "--plot", str(png)])
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert [row["workers"] for row in result["rows"]] == [1, 2, 4]
    assert result["rows"][0]["efficiency"] == 1.0 and 0 < result["rows"][2]["efficiency"] <= 1.0
    memory = [row["memory_bytes"] for row in result["rows"]]  # Adam: sharding pays from 2 workers on, more with more
    assert memory[0]["none"] < memory[0]["optimizer"]  # one worker: the shards are only a copy
    assert (
        memory[2]["none"] > memory[2]["optimizer"] >= memory[2]["gradients"] and memory[2]["optimizer"] < memory[1]["optimizer"]
    )
    assert any(line.startswith("memory per rank at a step's peak") for line in lines)
    assert png.stat().st_size > 10_000
    # A calibration measured on 2 ranks of one host, carried to 2 hosts of 2 ranks over a 10 Gbit/s preset.
    measured = Calibration(
        {"allreduce": (4e-4, 1.5e-10), "fp16": (3e-4, 4.6e-10), "bf16": (3e-4, 5e-10), "allgather": (9e-4, 2e-9)},
        1e11,
        measured_on=(2, 1),
    )
    (tmp_path / "cal.json").write_text(calibration_to_json(measured))
    args = ["--model", "test_predict:tiny_model", "--steps", "2", "--calibration", str(tmp_path / "cal.json")]
    main([*args, "--ranks-per-host", "2", "--workers", "2,4", "--link", "10gbit"])
    two_hosts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"][1]
    assert two_hosts["workers"] == 4 and two_hosts["ranks_per_host"] == 2 and two_hosts["step_ms"] > 0
    with pytest.raises(SystemExit, match="give the link between hosts"):
        main([*args, "--ranks-per-host", "2", "--workers", "4"])
    (tmp_path / "old.json").write_text(calibration_to_json(Calibration(measured.lines, 1e11)))
    with pytest.raises(SystemExit, match="does not say how many ranks"):
        main([*args[:-1], str(tmp_path / "old.json"), "--workers", "2"])
    with pytest.raises(SystemExit, match="--link or --calibration"):
        main(["--model", "test_predict:tiny_model", "--workers", "4", "--steps", "1"])
    with pytest.raises(SystemExit, match="cannot load the model factory"):
        main(["--model", "nowhere:model", "--workers", "1", "--steps", "1"])


@pytest.mark.timeout(120)
def test_device_flops_predicts_an_imagenet_model_without_running_it(capsys: pytest.CaptureFixture[str]) -> None:
    from shoal.predict.__main__ import main

    args = ["--model", "shoal.predict.published:vgg16", "--batch-size", "64", "--device-flops", "6e12", "--link", "1gbit"]
    rest = ["--link-latency-us", "5", "--intra-gbps", "10", "--bucket-bytes", "67108864", "--ranks-per-host", "4"]
    main([*args, *rest, "--workers", "1,8,64,512"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert rows[0]["step_ms"] == pytest.approx(3 * 64 * 30.94e9 / 6e12 * 1e3, rel=0.05)  # forward + 2x backward
    efficiencies = [row["efficiency"] for row in rows]
    assert efficiencies == sorted(efficiencies, reverse=True) and efficiencies[-1] < 1.0
    assert "fc" in rows[-1]["advice"] or "classifier" in rows[-1]["advice"]


def test_a_cpu_bound_step_overlaps_nothing() -> None:
    step = profile([("a", 3 * MB, 0.001), ("b", 3 * MB, 0.002)], backward=0.5)  # hidden when a core is free
    result = simulate(step, LINKS, workers=2, comm="allreduce", cpu_bound=True)
    assert result.step_s == pytest.approx(step.compute_s + 2 * ring_seconds(3 * MB, 2))


def test_a_cpu_bound_step_overlaps_only_the_wire_wait_of_each_exchange() -> None:
    """With a measured CPU share, only that share of each exchange takes from backward; the rest (waiting on the
    wire) overlaps it, and an exchange's busy time delays the gradients backward makes after it."""
    busy = Links(LINKS.inter, LINKS.intra, LINKS.cast_per_byte_s, LINKS.flops_per_s, cpu_share={"allreduce": 0.25})
    seconds = ring_seconds(3 * MB, 2)
    long_backward = profile([("a", 3 * MB, 0.001), ("b", 3 * MB, 0.002)], backward=0.5)  # the wire hides under it
    result = simulate(long_backward, busy, workers=2, comm="allreduce", cpu_bound=True)
    assert [e.cpu_s for e in result.exchanges] == pytest.approx([0.25 * seconds] * 2)
    assert result.step_s == pytest.approx(long_backward.compute_s + 2 * 0.25 * seconds)
    short_backward = profile([("a", 3 * MB, 0.001), ("b", 3 * MB, 0.002)], backward=0.02)  # the wire is the step
    result = simulate(short_backward, busy, workers=2, comm="allreduce", cpu_bound=True)
    assert result.exchanges[1].start_s == pytest.approx(0.001 + seconds)  # after a, not before its submission
    assert result.step_s == pytest.approx(0.01 + 0.001 + 2 * seconds + 0.005)
    late = profile([("a", 3 * MB, 0.001), ("b", 3 * MB, 0.4)], backward=0.4)  # b is made after a took its core time
    result = simulate(late, busy, workers=2, comm="allreduce", cpu_bound=True)
    assert result.exchanges[1].start_s == pytest.approx(0.4 + 0.25 * seconds)
    assert result.step_s == pytest.approx(0.01 + 0.4 + 0.25 * seconds + seconds + 0.005)
    not_measured = simulate(late, LINKS, workers=2, comm="allreduce", cpu_bound=True)  # all of it busy, as before
    assert not_measured.step_s == pytest.approx(late.compute_s + 2 * seconds)


def test_a_calibrations_cpu_share_survives_its_file_and_reaches_the_simulator() -> None:
    from shoal.plan.calibration import calibration_from_json

    lines = {"allreduce": (4e-4, 1.5e-10), "fp16": (3e-4, 4.6e-10), "bf16": (3e-4, 5e-10), "allgather": (9e-4, 2e-9)}
    measured = Calibration(lines, 1e11, measured_on=(2, 2), cpu_share={"allreduce": 0.2, "fp16": 0.5})
    loaded = calibration_from_json(calibration_to_json(measured), "cal.json")
    assert loaded == measured and loaded.cpu_seconds("fp16", 2.0) == 1.0 and loaded.cpu_seconds("allgather", 2.0) == 2.0
    links = Links.from_calibration(loaded, workers=2, hosts=2)
    assert links.calibration(8, 1).cpu_share == {"allreduce": 0.2, "fp16": 0.5}
    assert calibration_from_json(calibration_to_json(Calibration(lines, 1e11)), "old.json").cpu_share == {}
