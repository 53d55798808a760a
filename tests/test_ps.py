"""The sharded parameter server: balanced sharding, BSP equal to synchronous training (co-located and dedicated),
the SSP staleness bound under a slow worker, async progress, dead servers and workers reported by name, mixing
with allreduce per layer, and the planner's ps prediction.

Reference rule as in test_optimizer: N workers x batch B under BSP give the weights of one process with batch N*B,
within atol 1e-5 (fp32; only the order of summation differs).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

import shoal.torch as hvd
from shoal.config import LaunchConfig
from shoal.plan.calibration import Calibration
from shoal.plan.planner import format_plan, predict
from shoal.ps.consistency import PieceClocks, PullRecorder
from shoal.ps.launch import server_processes
from shoal.ps.optimizers import describe_optimizer
from shoal.ps.sharding import build_shard_plan, server_loads
from shoal.testing import MultiRankError, run_ranks
from shoal.torch.layer_comm.layers import build_plan

BATCH = 4
STEPS = 3
ATOL = 1e-5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def data(size: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(steps, size * BATCH, 8, generator=generator), torch.randn(steps, size * BATCH, 4, generator=generator)


def reference(size: int, optimizer: str) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    model = Net()
    local = OPTIMIZERS[optimizer](model.parameters())
    x, y = data(size, STEPS)
    for step in range(STEPS):
        local.zero_grad()
        nn.functional.mse_loss(model(x[step]), y[step]).backward()
        local.step()
    return {k: v.numpy() for k, v in model.state_dict().items()}


def _train(optimizer: str, comm: str, options: dict[str, object], steps: int = STEPS, slow_rank: int = -1) -> dict[str, object]:
    """One worker: train ``steps`` steps on its slice of the data; returns weights, losses and its server's record."""
    from shoal.ps.connect import local_server

    hvd.init()
    torch.manual_seed(hvd.rank())  # different on purpose: broadcast_parameters must fix it
    model = Net()
    if options.pop("same_data_every_step", False):
        x, y = data(hvd.size(), 1)
        x, y = x.expand(steps, -1, -1), y.expand(steps, -1, -1)
    else:
        x, y = data(hvd.size(), steps)
    wrapped = hvd.DistributedOptimizer(
        OPTIMIZERS[optimizer](model.parameters()), named_parameters=model.named_parameters(), model=model, comm=comm, **options
    )  # type: ignore[arg-type]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rows = slice(hvd.rank() * BATCH, (hvd.rank() + 1) * BATCH)
    losses = []
    started, finished = [], []  # per step: wall time before its backward (its pushes), after its step (its pulls)
    for step in range(steps):
        wrapped.zero_grad()
        loss = nn.functional.mse_loss(model(x[step, rows]), y[step, rows])
        started.append(time.time())
        loss.backward()
        if hvd.rank() == slow_rank:
            time.sleep(0.03)
        wrapped.step()
        finished.append(time.time())
        losses.append(loss.item())
    hvd.barrier()  # every pull was served before the recorder is read
    server = local_server()
    return {
        "weights": {k: v.numpy() for k, v in model.state_dict().items()},
        "losses": losses,
        "max_gap": server.recorder.max_gap() if server is not None else None,
        "started": started,
        "finished": finished,
        "pulls": len(server.recorder.events) if server is not None else 0,
    }


def _party(optimizer: str, comm: str, options: dict[str, object], steps: int = STEPS) -> dict[str, object] | None:
    """A rank of a dedicated-server job: the server module's real entry point, or a worker."""
    if os.environ.get("SHOAL_PS_ROLE") == "server":
        from shoal.ps.server import main

        main()  # exits the process (0 when every worker said goodbye)
    return _train(optimizer, comm, options, steps)


def dedicated(workers: int, servers: int) -> dict[str, object]:
    """run_ranks arguments for ``workers`` Horovod ranks followed by ``servers`` dedicated server processes, with
    the environment that ``shoal.ps.launch`` tells shoalrun to set (run_ranks supplies the rendezvous)."""
    rendezvous = {"SHOAL_RENDEZVOUS_ADDR": "-", "SHOAL_RENDEZVOUS_PORT": "-", "SHOAL_SECRET": "-"}
    overrides: dict[int, dict[str, str]] = {}
    for rank in range(workers):
        overrides[rank] = {
            f"{prefix}_{name}": str(workers) for prefix in ("SHOAL", "HOROVOD") for name in ("SIZE", "LOCAL_SIZE")
        }
        overrides[rank].update(LaunchConfig(num_servers=servers).worker_env())  # what shoalrun gives every worker
    for index, (argv, env) in enumerate(server_processes(servers, workers, rendezvous)):
        assert argv[1:] == ["-m", "shoal.ps.server"]
        overrides[workers + index] = {k: v for k, v in env.items() if k not in rendezvous}
    return {"rank_env_overrides": overrides}


def assert_matches(expected: dict[str, np.ndarray], results: list[dict[str, object]], label: str) -> None:
    for rank, result in enumerate(results):
        for name, value in expected.items():
            np.testing.assert_allclose(result["weights"][name], value, atol=ATOL, err_msg=f"{label}: rank {rank}, {name}")  # type: ignore[index]


# ----- sharding, consistency, optimizers (no processes) -----


def test_sharding_balances_bytes_and_splits_large_tensors() -> None:
    sizes = [(4096 * 1024, 4), (1024, 4), (512 * 512, 4), (10, 4), (300_000, 2)]
    for servers in (1, 2, 3, 5):
        pieces = build_shard_plan(sizes, servers)
        loads = server_loads(pieces, servers)
        total = sum(n * b for n, b in sizes)
        assert sum(loads) == total
        assert max(loads) - min(loads) <= 2 * 4, (servers, loads)  # within an element or two of equal
        for param, (numel, _) in enumerate(sizes):  # every element covered once, in contiguous order
            mine = [q for q in pieces if q.param == param]
            assert [q.start for q in mine] == list(np.cumsum([0] + [q.numel for q in mine[:-1]]))
            assert sum(q.numel for q in mine) == numel
    big = [q for q in build_shard_plan(sizes, 3) if q.param == 0]
    assert len({q.server for q in big}) == 3  # the huge layer does not land on one server
    assert build_shard_plan(sizes, 3) == build_shard_plan(sizes, 3)  # deterministic: every party agrees


def test_ssp_clocks_release_pulls_within_the_bound() -> None:
    clocks = PieceClocks(2)
    clocks.pending.append((0, clocks.advance(0, 0)))
    clocks.pending.append((0, clocks.advance(0, 1)))
    assert clocks.take_servable(1) == [(0, 1)]  # clock 2 leads the slowest (0) by 2 > s = 1
    clocks.advance(1, 0)
    assert clocks.take_servable(1) == [(0, 2)]
    clocks.retire(1)
    clocks.pending.append((0, clocks.advance(0, 2)))
    assert clocks.take_servable(0) == [(0, 3)]  # a worker that left holds nobody back
    recorder = PullRecorder()
    recorder.record(0, 3, 1)
    assert recorder.max_gap() == 2


def test_only_element_wise_optimizers_run_on_servers() -> None:
    name, groups = describe_optimizer(torch.optim.SGD, torch.optim.SGD(Net().parameters(), lr=0.5, momentum=0.9).param_groups)
    assert name == "SGD" and groups[0]["lr"] == 0.5 and groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="supports"):
        describe_optimizer(torch.optim.RMSprop, torch.optim.RMSprop(Net().parameters()).param_groups)


# ----- BSP equals synchronous training -----


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_bsp_colocated_matches_one_process(optimizer: str) -> None:
    expected = reference(2, optimizer)
    results = run_ranks(_train, 2, args=(optimizer, "ps", {"ps_mode": "bsp"}), timeout_s=60)
    assert_matches(expected, results, f"co-located {optimizer}")
    assert all(r["max_gap"] == 0 and r["pulls"] > 0 for r in results)


@pytest.mark.parametrize(("optimizer", "servers"), [("sgd-momentum", 2), ("adam", 1)])
def test_bsp_dedicated_matches_one_process(optimizer: str, servers: int) -> None:
    expected = reference(2, optimizer)
    results = run_ranks(_party, 2 + servers, args=(optimizer, "ps", {}), timeout_s=60, **dedicated(2, servers))  # type: ignore[arg-type]
    assert results[2:] == [None] * servers  # servers exited 0 after every worker's goodbye
    assert_matches(expected, results[:2], f"dedicated {optimizer}, {servers} servers")


def test_ps_for_one_layer_mixes_with_allreduce() -> None:
    expected = reference(2, "sgd-momentum")
    options = {"comm_overrides": {"fc1": "ps"}}
    assert_matches(expected, run_ranks(_train, 2, args=("sgd-momentum", "allreduce", options), timeout_s=60), "fc1 on ps")


# ----- SSP and async -----


def test_ssp_never_exceeds_the_staleness_bound_with_a_slow_worker() -> None:
    staleness = 2
    options = {"ps_mode": "ssp", "ps_staleness": staleness}
    results = run_ranks(_train, 2, args=("sgd-momentum", "ps", options, 12, 1), timeout_s=60)
    gaps = [float(r["max_gap"]) for r in results]
    assert max(gaps) <= staleness, gaps
    assert max(gaps) > 0, f"the fast worker never ran ahead, so the bound was not exercised: {gaps}"
    # The same bound from the workers' own clocks, independent of the server's bookkeeping: when the fast worker
    # finished step c (its pulls served), the slow one must have pushed step c - s, so it had started that step's
    # backward before then.
    fast, slow = results[0], results[1]
    leads = []
    for step, done in enumerate(fast["finished"]):  # type: ignore[arg-type]
        slow_started = sum(1 for t in slow["started"] if t <= done)  # type: ignore[union-attr]
        assert slow_started >= step + 1 - staleness, (step, slow_started)
        leads.append(step + 1 - slow_started)
    assert max(leads) >= 1, f"the fast worker never led, so the bound was not exercised: {leads}"


def test_async_trains() -> None:
    options = {"ps_mode": "async", "same_data_every_step": True}
    for result in run_ranks(_train, 2, args=("sgd-momentum", "ps", options, 15, 1), timeout_s=60):
        losses = result["losses"]
        assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses


# ----- failures: named, never a hang -----


def _dying_party(victim: str, after_pulls: int) -> dict[str, object] | None:
    """A dedicated-server job where the server (or worker 1) SIGKILLs itself mid-training."""
    if os.environ.get("SHOAL_PS_ROLE") == "server":
        from shoal.comm.p2p import connect_job_store
        from shoal.ps.server import build_dedicated_server

        store = connect_job_store(
            os.environ["SHOAL_RENDEZVOUS_ADDR"], int(os.environ["SHOAL_RENDEZVOUS_PORT"]), os.environ["SHOAL_SECRET"], 30
        )
        recorder = PullRecorder()
        server = build_dedicated_server(store, 2, 1, 0, recorder)

        def kill_after_some_pulls() -> None:
            while len(recorder.events) < after_pulls:
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGKILL)

        if victim == "server":
            threading.Thread(target=kill_after_some_pulls, daemon=True).start()
        server.serve()
        return None
    from shoal.ps.client import ParameterServerError

    hvd.init()
    model = Net()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm="ps")
    last_step = time.monotonic()
    try:
        for step in range(10_000):
            if victim == "worker" and hvd.rank() == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            last_step = time.monotonic()
    except ParameterServerError as error:
        return {"message": str(error), "after_s": time.monotonic() - last_step}
    return {"message": "trained to the end", "after_s": 0.0}


def test_a_killed_server_is_named_on_every_worker() -> None:
    with pytest.raises(MultiRankError) as caught:
        run_ranks(_dying_party, 3, args=("server", 20), timeout_s=60, **dedicated(2, 1))  # type: ignore[arg-type]
    outcomes = caught.value.outcomes
    assert outcomes[2].exitcode == -signal.SIGKILL
    for worker in (0, 1):
        # The worker caught the error, so a shutdown-time exception is the only way it fails.
        assert outcomes[worker].error is None, outcomes[worker].error
        result = outcomes[worker].result
        assert result is not None, outcomes  # no result and no error: killed after the grace, or died without a word
        assert "parameter server 0" in result["message"] and "vanished" in result["message"], result
        assert result["after_s"] < 10, result


def test_a_killed_worker_is_named_on_the_others() -> None:
    with pytest.raises(MultiRankError) as caught:
        run_ranks(_dying_party, 3, args=("worker", 0), timeout_s=60, **dedicated(2, 1))  # type: ignore[arg-type]
    outcomes = caught.value.outcomes
    assert outcomes[1].exitcode == -signal.SIGKILL
    assert "worker 1" in outcomes[0].result["message"], outcomes[0]
    assert outcomes[2].exitcode == 1  # the server stopped, saying why (its stderr names worker 1)


# ----- the planner -----

CALIBRATION = Calibration.uniform(latency_s=1e-4, s_per_byte=1e-9, flops_per_s=5e10)


def test_planner_predicts_ps_and_chooses_it_only_when_servers_exist() -> None:
    assert "ps" not in predict(CALIBRATION, 8, 1024, None)  # no server count: no ps prediction
    # Bytes: a worker pushes and pulls 2n against the ring's 2(P-1)/P n, so ps never wins a big layer here; but
    # a small layer is latency-bound, and 2 messages beat the ring's 2(P-1).
    small, big = predict(CALIBRATION, 8, 1024, None, servers=8), predict(CALIBRATION, 8, 64 << 20, None, servers=8)
    assert small["ps"] < small["allreduce"] and big["ps"] > big["allreduce"]
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    no_ps = ("allreduce", "fp16", "bf16", "sfb")
    unconfigured = build_plan(model, CALIBRATION, 8, {}, allowed=no_ps, servers=8)
    assert all("ps" in p.predicted_ms and p.choice != "ps" for p in unconfigured)
    configured = build_plan(model, CALIBRATION, 8, {}, servers=8)
    assert [p.choice for p in configured] == ["ps", "ps"]
    assert "ps ms" in format_plan(configured, 8).splitlines()[1]
    forced = build_plan(nn.Sequential(nn.Linear(4096, 4096)), CALIBRATION, 2, {}, {nn.Linear: "ps"})
    assert [(p.choice, p.forced) for p in forced] == [("ps", True)]
