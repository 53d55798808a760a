"""``shoalrun --num-servers``: dedicated parameter servers start beside the workers and end with them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, SHOALRUN, clean_env

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, shoal.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), model=model, comm="ps")
    hvd.broadcast_parameters(model.state_dict(), 0)
    x = torch.randn(64, 8)
    y = (x.sum(1) > 0).long()
    losses = []
    for step in range(int(sys.argv[1])):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[hvd.rank()::hvd.size()]), y[hvd.rank()::hvd.size()])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 2:
            print("pid", os.getpid(), flush=True)
    print("first", losses[0], "last", losses[-1], flush=True)
    hvd.shutdown()
    """
)


def run_job(tmp_path: Path, steps: int, servers: int, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "ps_job.py"
    script.write_text(SCRIPT)
    command = [*SHOALRUN, "-np", "2", "--num-servers", str(servers), sys.executable, str(script), str(steps)]
    return subprocess.run(command, env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("servers", [1, 2])
def test_dedicated_servers_train_and_leave_with_the_workers(tmp_path: Path, servers: int) -> None:
    result = run_job(tmp_path, 40, servers)
    assert result.returncode == 0, result.stderr[-3000:]
    finals = [line for line in result.stdout.splitlines() if "first" in line]
    assert len(finals) == 2, result.stdout
    for line in finals:
        words = line.split()
        assert float(words[-1]) < float(words[-3]) * 0.8, line  # the loss went down on every worker
    for index in range(servers):  # the dedicated servers did the serving, and left on their own
        assert f"[server.{index}]<stdout>:shoal.ps.server: parameter server {index}" in result.stdout, result.stdout
    assert result.stdout.count("every worker said goodbye") == servers


def test_bad_num_servers_is_a_one_line_error() -> None:
    result = subprocess.run(
        [*SHOALRUN, "-np", "2", "--num-servers", "-1", "true"], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "--num-servers must be >= 0" in result.stderr
    result = subprocess.run(
        [*SHOALRUN, "-np", "2", "--min-np", "1", "--num-servers", "1", "true"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "cannot be combined with elastic" in result.stderr


def test_a_worker_ending_on_an_exception_says_no_goodbye() -> None:
    # hvd.shutdown() runs from atexit after an uncaught exception; the parameter-server client must then not say
    # goodbye (the servers would retire the worker quietly) but let the dropped connection name it to the others.
    code = textwrap.dedent(
        """
        import atexit
        from shoal.ps.client import exiting_on_error
        atexit.register(lambda: print("exiting_on_error", exiting_on_error(), flush=True))
        print("before", exiting_on_error(), flush=True)
        raise RuntimeError("boom")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "RuntimeError: boom" in result.stderr
    assert result.stdout.split() == ["before", "False", "exiting_on_error", "True"]


def test_optimizer_settings_the_servers_cannot_honour_are_refused() -> None:
    import torch

    from shoal.ps.optimizers import describe_optimizer

    params = torch.nn.Linear(2, 2).parameters()
    with pytest.raises(ValueError, match="decoupled_weight_decay=True"):
        describe_optimizer(torch.optim.Adam, torch.optim.Adam(params, decoupled_weight_decay=True).param_groups)
    name, groups = describe_optimizer(
        torch.optim.SGD, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9, foreach=False).param_groups
    )
    assert name == "SGD" and groups[0]["momentum"] == 0.9  # how torch runs the update (foreach) is not refused
