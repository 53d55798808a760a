"""Every command shown in README.md and docs/*.md is run by a test, and the README's Python examples run.

A command is a line of a shell code block (a fence with no language, or sh/bash/shell). Each one is either run
here as written (placeholders such as ``train.py`` are small real scripts written to a scratch directory), or
named in ``COVERED`` with the test that runs it and the parts of the command that test must contain, or, for the
two lines CI itself executes, in ``CI_ITSELF``. A new command in the docs fails ``test_every_documented_command``
until it is placed in one of them.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO, clean_env
from shoal.testing import run_ranks

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_FENCES = {"", "sh", "bash", "shell"}

TRAIN_PY = """
import json
import torch
import shoal.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(5):
    torch.manual_seed(100 + 10 * step + hvd.rank())
    x = torch.randn(4, 8)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    optimizer.step()
total = hvd.allreduce(torch.tensor([sum(p.sum().item() for p in model.parameters())]), op=hvd.Max)
print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "weights": round(total.item(), 6)}), flush=True)
"""

# Command -> (the test that runs it, as file::function; words its source must contain).
COVERED: dict[str, tuple[str, list[str]]] = {
    "shoalrun -np 8 -H a:4,b:4 python train.py": (
        "test_launchers.py::test_two_host_run_over_ssh_from_a_venv_with_a_bare_python",
        ["-H", "127.0.0.2"],
    ),  # a, b: placeholders for real hosts
    "python -m shoal.runner.preload_server /tmp/torch.sock &": (
        "test_forkserver.py::test_a_preload_server_forks_each_jobs_fork_server_and_refuses_what_it_did_not_preload",
        ["_start_preload_server(socket_path)", "SIGTERM"],
    ),
    "shoalrun --preload-server /tmp/torch.sock -np 2 python train.py": (
        "test_forkserver.py::test_a_preload_server_forks_each_jobs_fork_server_and_refuses_what_it_did_not_preload",
        ["--preload-server", '"-np", "2"'],
    ),
    "shoalrun -np 2 python -m shoal.bench.allreduce": (
        "test_examples.py::test_allreduce_benchmark_json_contract",
        ["-np", "shoal.bench.allreduce"],
    ),
    "shoalrun -np 2 python -m shoal.bench.train --model mlp --compare ddp": (
        "test_examples.py::test_train_benchmark_json_contract",
        ["shoal.bench.train", "mlp", "ddp_ips"],
    ),
    "shoalrun -np 2 python -m shoal.bench.train --model mlp --profile": (
        "test_examples.py::test_train_benchmark_json_contract",
        ["shoal.bench.train", "mlp", "--profile"],
    ),
    "python -m shoal.bench.netns --hosts 2 --ranks-per-host 2 --rate 1gbit -- python -m shoal.bench.allreduce": (
        "test_launchers.py::test_two_emulated_hosts_in_network_namespaces",
        ["shoal.bench.netns", "--ranks-per-host", "1gbit"],
    ),
    "python -m shoal.bench.planner --hosts 2 --rate 1gbit --model mlp --runs 5": (
        "test_examples.py::test_planner_benchmark_compares_auto_with_every_forced_scheme",
        ["shoal.bench.planner", "1gbit", "mlp"],
    ),
    "python -m shoal.bench.netns --hosts 2 --rate 100mbit -- python -m shoal.bench.far --rate 100mbit": (
        "test_far.py::test_far_benchmark_json_contract_on_two_emulated_hosts",
        ["shoal.bench.netns", "shoal.bench.far", "100mbit"],
    ),
    "python -m shoal.bench.netns --hosts 2 --rate 100mbit -- python -m shoal.bench.far --task chars --rate 100mbit": (
        "test_far.py::test_far_benchmark_json_contract_on_two_emulated_hosts",
        ["shoal.bench.far", "chars", "100mbit"],
    ),
    "shoalrun -np 2 python -m shoal.bench.shard --model mlp": (
        "test_sharding.py::test_shard_benchmark_compares_stages_with_ddp_and_torch_zero_in_one_run",
        ["shoal.bench.shard", "mlp", "-np"],
    ),
    "python -m shoal.bench.startup --np 2,4": (
        "test_examples.py::test_startup_benchmark_times_forked_fresh_and_torchrun_jobs",
        ["shoal.bench.startup", "--np"],
    ),
    "python -m shoal.bench.rendezvous": (
        "test_examples.py::test_rendezvous_benchmark_times_both_stores",
        ["shoal.bench.rendezvous"],
    ),
    "python -m shoal.predict --model mlp --workers 1,2,4,8,16 --link 10gbit --plot scaling.png": (
        "test_predict.py::test_command_line_prints_a_row_per_worker_count_and_a_json_line",
        ["--workers", "--link", "--plot"],
    ),
    "python -m shoal.predict --model mlp --calibration cal.json --ranks-per-host 2 --workers 2,4,8 --link 10gbit": (
        "test_predict.py::test_command_line_prints_a_row_per_worker_count_and_a_json_line",
        ["--calibration", "--ranks-per-host", "10gbit"],
    ),
    "shoalrun -np 2 python -m shoal.predict.calibrate -o cal.json": (
        "test_examples.py::test_predicted_two_rank_shared_memory_cnn_is_close_to_a_measured_run",
        ["shoal.bench.predict", "shm:1x2"],
    ),  # bench.predict runs it under shoalrun -np 2 for the shm:1x2 setting
    "python -m shoal.bench.predict": (
        "test_examples.py::test_predicted_two_rank_shared_memory_cnn_is_close_to_a_measured_run",
        ["shoal.bench.predict"],
    ),
    "python -m shoal.predict --model shoal.predict.published:vgg16 --batch-size 64 --device-flops 6e12 --link 25gbit "
    "--link-latency-us 5 --intra-gbps 10 --ranks-per-host 4 --workers 1,4,8,16,32,64,128,256,512 --bucket-bytes 67108864": (
        "test_predict.py::test_device_flops_predicts_an_imagenet_model_without_running_it",
        ["published:vgg16", "--device-flops", "--link-latency-us", "--intra-gbps", "--bucket-bytes"],
    ),
    "srun -n 2 python examples/digits.py": (
        "test_slurm.py::test_srun_without_shoalrun_takes_slurm_step_environment_and_trains",
        ['"srun", "-n", "2"', "examples/digits.py"],
    ),  # a real single-node Slurm (tests/slurm_cluster.py)
    "salloc -n 2 shoalrun -np 2 python train.py": (
        "test_slurm.py::test_shoalrun_in_salloc_uses_the_allocation",
        ['"salloc", "-n", "2", *SHOALRUN, "-np", "2"'],
    ),
    "sbatch examples/slurm/elastic.sbatch": (
        "test_slurm.py::test_elastic_job_leaves_at_a_commit_on_usr1",
        ["slurm.sbatch(", "examples/slurm/elastic.sbatch"],
    ),
    "scancel --batch --signal=USR1 <job id>": (
        "test_slurm.py::test_elastic_job_leaves_at_a_commit_on_usr1",
        ['"scancel", who, "--signal=USR1"', "scancel --batch --signal=USR1"],  # who: --batch (and --full)
    ),
    "sbatch examples/slurm/checkpointed.sbatch": (
        "test_slurm.py::test_requeued_job_resumes_from_its_checkpoint",
        ["_checkpointed_job("],  # which submits examples/slurm/checkpointed.sbatch with sbatch
    ),
    "scontrol requeue <job id>": (
        "test_slurm.py::test_requeued_job_resumes_from_its_checkpoint",
        ['"scontrol", "requeue", job'],
    ),
    "sbatch examples/slurm/train.sbatch": (
        "test_clusters.py::test_sbatch_example_trains_under_a_simulated_slurm_allocation",
        ["examples/slurm/train.sbatch", "FAKE_SRUN", "SLURM_JOB_NODELIST"],
    ),  # the script as sbatch runs it (bash, in the submit directory), srun a stand-in with Slurm's variables
    "python examples/ray_digits.py --num-workers 2": (
        "test_ray.py::test_digits_example_reaches_95_percent_on_two_ray_workers",
        ["ray_digits.py", "--num-workers"],
    ),  # against the test's local cluster (--address) instead of starting one
    "shoalrun -np 2 python examples/lightning_digits.py": (
        "test_lightning.py::test_digits_lightning_module_reaches_95_percent_on_two_ranks",
        ["lightning_digits.py", '"-np", "2"'],
    ),
    "shoalrun -np 2 python examples/tf2_digits.py": (
        "test_tensorflow.py::test_tf2_digits_example_reaches_95_percent",
        ["tf2_digits.py", '"-np"'],
    ),
    "shoalrun -np 2 python examples/tensorflow2_synthetic_benchmark.py --model cnn": (
        "test_tensorflow.py::test_tensorflow2_synthetic_benchmark_reports_rates",
        ["tensorflow2_synthetic_benchmark.py", '"-np", "2"'],
    ),  # the test runs the MLP, a faster model on 2 cores
    "python -m shoal.bench.train_tf --workers 2": (
        "test_tensorflow.py::test_train_tf_benchmark_compares_shoal_with_multi_worker_mirrored_strategy",
        ["shoal.bench.train_tf", '"--workers", "2"'],
    ),  # the test runs the digits model with fewer steps
    "shoalrun -np 2 --min-np 1 python examples/keras_elastic_digits.py": (
        "test_tf_extras.py::test_elastic_keras_example_survives_a_sigkilled_worker",
        ["keras_elastic_digits.py", '"--min-np"', "SIGKILL"],
    ),
    "shoalrun -np 2 python examples/keras_digits.py": (
        "test_keras.py::test_keras_digits_example_reaches_95_percent",
        ["keras_digits.py", '"-np"'],
    ),
    "python -m shoal.bench.on_ray --workers 2 --model mlp": (
        "test_ray.py::test_on_ray_benchmark_compares_the_executor_with_shoalrun",
        ["shoal.bench.on_ray", "--workers", "mlp"],
    ),
    "python -m shoal.bench.netns --hosts 2 --rate 100mbit -- python -m shoal.bench.train --model mlp --comm auto-lossy "
    "--compare ddp,ddp-powersgd": (
        "test_examples.py::test_train_benchmark_lossy_against_ddp_and_its_powersgd_hook_on_a_slow_link",
        ["shoal.bench.netns", "shoal.bench.train", "auto-lossy", "ddp,ddp-powersgd"],
    ),  # the test runs at 1 Gbit/s for 3 steps
    "python -m shoal.bench.netns --hosts 2 --rate 100mbit -- python -m shoal.bench.accuracy --model mlp --plot acc.png": (
        "test_examples.py::test_accuracy_benchmark_curves_targets_and_plot",
        ["shoal.bench.accuracy", "--plot", "mlp"],
    ),  # the test runs a small MLP for 3 epochs on one host
    "python -m shoal.bench.unequal": (
        "test_examples.py::test_unequal_benchmark_json_contract",
        ["shoal.bench.unequal", "--transition-steps"],
    ),  # the test runs a small model for a few steps
    "python -m shoal.bench.churn --workers 3 --minutes 5 --mean-interval 30": (
        "test_churn.py::test_a_short_churn_run_keeps_the_contract",
        ["shoal.bench.churn", '"--workers", "3"', '"--minutes"'],
    ),  # the test runs 24 s per job with 3 events instead of 5 minutes with one every 30 s on average
    "python -m shoal.bench.on_spark --workers 2 --model mlp": (
        "test_spark.py::test_on_spark_benchmark_compares_shoal_spark_run_with_shoalrun",
        ["shoal.bench.on_spark", '"--workers", "2"', "mlp"],
    ),  # the test times fewer steps
    "shoalrun -np 1 python -m shoal.bench.gpu_check": (
        "test_examples.py::test_gpu_check_script_passes_its_checks_on_cpu",
        ["shoal.bench.gpu_check", "cpu"],
    ),
    "shoalrun -np 3 --min-np 2 python examples/elastic_digits.py": (
        "test_elastic.py::test_sigkill_one_of_three_workers_finishes_with_two",
        ['"-np", "3"', '"--min-np", "2"'],
    ),
    "shoalrun -np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py": (
        "test_elastic.py::test_discovery_adds_a_worker_that_receives_rank_0_state",
        ["--max-np", "--host-discovery-script"],
    ),
}
CI_ITSELF = {
    "make test": ".ci/run runs it (this suite is its last step)",
    "make check": "make test runs the same lint and every test it runs (those marked check); "
    "test_make_targets_install_and_run_what_they_say checks what it runs",
}
NEEDS_A_CLUSTER = {
    "kubectl apply -f docs/kubernetes/pytorchjob.yaml": (
        "needs Kubernetes with Kubeflow's training operator; test_clusters.py checks the manifest and runs two "
        "processes with the variables the operator gives its pods"
    ),
}


def _strip_comment(line: str) -> str:
    return re.split(r"\s+#\s", line, maxsplit=1)[0].strip()


def code_blocks(page: Path) -> list[tuple[str, list[str]]]:
    """Every fenced block of a page: (its language, its lines)."""
    blocks: list[tuple[str, list[str]]] = []
    fence: str | None = None
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            if fence is None:
                fence = line[3:].strip()
                blocks.append((fence, []))
            else:
                fence = None
        elif fence is not None:
            blocks[-1][1].append(line)
    return blocks


def documented_commands() -> dict[str, list[str]]:
    """Every command line of every shell block -> the pages showing it."""
    found: dict[str, list[str]] = {}
    for page in DOCS:
        for fence, lines in code_blocks(page):
            for line in lines:
                if fence in SHELL_FENCES and line.strip() and not line.lstrip().startswith("#"):
                    found.setdefault(_strip_comment(line), []).append(page.name)
    return found


def run(command: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 180) -> str:
    """Run a documented command line with bash in ``cwd``; ``python`` is this interpreter."""
    environment = clean_env() if env is None else env
    environment["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environment.get('PATH', '')}"
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{command!r} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


def weights_lines(output: str, size: int) -> list[str]:
    """The training script's result lines; every rank must end with the same weights."""
    lines = re.findall(r'\{"rank": \d+, "size": \d+, "weights": [-\d.e]+\}', output)
    assert len(lines) == size, output[-2000:]
    assert len({line.split('"weights":')[1] for line in lines}) == 1, lines
    assert all(f'"size": {size}' in line for line in lines), lines
    return lines


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(TRAIN_PY)
    (tmp_path / "hvd_train.py").write_text(TRAIN_PY.replace("import shoal.torch as hvd", "import horovod.torch as hvd"))
    return tmp_path


def _run_install(command: str, scratch: Path) -> None:
    if command == "pip install ./shoal":
        # The non-editable install, without the index: build from this checkout into a scratch prefix, then import
        # every subpackage from there (a package left out of the wheel fails here).
        (scratch / "shoal").symlink_to(REPO)
        run(f"python -m pip install --quiet --no-deps --no-build-isolation --target {scratch}/site ./shoal", scratch)
        env = clean_env()
        env["PYTHONPATH"] = str(scratch / "site")
        site = str(scratch / "site")
        check = (
            f"import pkgutil, shoal; assert shoal.__file__.startswith({site!r}), shoal.__file__; "
            "[__import__(m.name) for m in pkgutil.walk_packages(shoal.__path__, 'shoal.') if m.ispkg]; "
            "import shoal.torch, shoal.timeline, shoal.compat; print('ok')"
        )
        assert run(f'python -c "{check}"', scratch, env).strip() == "ok"
    elif command == "pip install './shoal[autotune,config,plot]'":
        # make install's '.[dev]' holds these extras; check they are declared and their modules import.
        (scratch / "shoal").symlink_to(REPO)
        out = run(
            "python -m pip install --dry-run --no-deps --no-build-isolation --quiet --report - './shoal[autotune,config,plot]'",
            scratch,
        )
        assert '"requested_extras"' in out and "autotune" in out, out[-1000:]
        run('python -c "import optuna, yaml, matplotlib"', scratch)
    else:
        run(command, scratch)  # pip install torch==2.13.0: already satisfied, no download


RUN_HERE = {
    "pip install torch==2.13.0": _run_install,
    "pip install ./shoal": _run_install,
    "pip install './shoal[autotune,config,plot]'": _run_install,
}


def test_every_documented_command_is_run_by_a_test() -> None:
    documented = documented_commands()
    placed = set(RUN_HERE) | set(COVERED) | set(CI_ITSELF) | set(NEEDS_A_CLUSTER) | set(RUN_AS_WRITTEN) | set(TIMELINE_SEQUENCE)
    missing = {c: pages for c, pages in documented.items() if c not in placed}
    stale = placed - set(documented)
    assert not missing, f"documented commands no test runs (add them to tests/test_docs.py): {missing}"
    assert not stale, f"tests/test_docs.py lists commands the docs no longer show: {stale}"


@pytest.mark.parametrize("command", sorted(COVERED))
def test_covered_commands_name_a_test_that_runs_them(command: str) -> None:
    reference, words = COVERED[command]
    file_name, function = reference.split("::")
    tree = ast.parse((REPO / "tests" / file_name).read_text())
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function]
    assert found, f"{reference} does not exist"
    source = ast.get_source_segment((REPO / "tests" / file_name).read_text(), found[0]) or ""
    for word in words:
        assert word in source, f"{reference} does not contain {word!r}: it may no longer run {command!r}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", sorted(RUN_HERE))
def test_install_commands(command: str, scratch: Path) -> None:
    RUN_HERE[command](command, scratch)


RUN_AS_WRITTEN = {
    "shoalrun -np 4 python train.py": 4,
    "shoalrun --horovod-compat -np 2 python hvd_train.py": 2,
    "torchrun --nproc-per-node 2 train.py": 2,
    "mpirun -np 2 python train.py": 2,
    "make demo": 0,
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", sorted(RUN_AS_WRITTEN))
def test_launch_commands_run_as_written(command: str, scratch: Path) -> None:
    env = clean_env()
    if command.startswith("make"):
        if not (REPO / ".venv" / "bin" / ".installed").exists():
            pytest.skip("make demo would create .venv first (make test has made it in CI)")
        assert '"test_accuracy"' in run(command, REPO, env, timeout=230)
        return
    if command.startswith("mpirun"):
        if shutil.which("mpirun") is None:
            pytest.skip("OpenMPI's mpirun is not installed")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # CI runs as root
    if command.startswith(("torchrun", "mpirun")):
        env["SHOAL_SECRET"] = "docs-test-secret"  # as the docs ask (docs/security.md)
    weights_lines(run(command, scratch, env), RUN_AS_WRITTEN[command] or 2)


TIMELINE_SEQUENCE = [
    "shoalrun -np 2 --timeline-filename timeline.json python train.py",
    "shoalrun -np 2 --timeline-filename 'tl-{rank}.json' python train.py",
    "python -m shoal.timeline merge tl-0.json tl-1.json -o merged.json",
    "python -m shoal.timeline summary merged.json",
    "python -m shoal.timeline plot merged.json --steps 3 -o timeline.png",
]


@pytest.mark.timeout(240)
def test_timeline_commands_in_order(scratch: Path) -> None:
    outputs = [run(command, scratch) for command in TIMELINE_SEQUENCE]
    assert (scratch / "timeline.json").exists() and (scratch / "tl-1.json").exists()
    assert "communication hidden under backward:" in outputs[3] and "arrived last:" in outputs[3]
    assert (scratch / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def _python_blocks(page: Path) -> list[str]:
    return ["\n".join(lines) for fence, lines in code_blocks(page) if fence == "python"]


README_PRELUDE = """
Net = lambda: torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
loss_fn = torch.nn.CrossEntropyLoss()
torch.manual_seed(1)
_x, _y = torch.randn(32, 6), torch.randint(0, 3, (32,))
_sampler = torch.utils.data.DistributedSampler(torch.utils.data.TensorDataset(_x, _y), num_replicas=2, rank=RANK,
                                               shuffle=False)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_x, _y), batch_size=4, sampler=_sampler)
"""


def _readme_training() -> list[float]:
    torch.set_num_threads(1)
    namespace: dict[str, Any] = {"torch": torch, "RANK": int(os.environ["SHOAL_TEST_RANK"])}
    exec(README_PRELUDE, namespace)
    exec(_python_blocks(REPO / "README.md")[0], namespace)
    model = namespace["model"]
    return [float(p.sum()) for p in model.parameters()]


def test_readme_training_example_runs_and_ranks_agree() -> None:
    envs = {rank: {"SHOAL_TEST_RANK": str(rank)} for rank in range(2)}
    results = run_ranks(_readme_training, 2, rank_env_overrides=envs, timeout_s=90)
    assert results[0] == results[1], results  # every rank ends with the same weights


def test_readme_shoal_run_example(tmp_path: Path) -> None:
    block = _python_blocks(REPO / "README.md")[1]
    assert "shoal.run(train_fn" in block
    (tmp_path / "train_module.py").write_text(
        textwrap.dedent("""
        def train_fn(config):
            import shoal.torch as hvd

            hvd.init()
            return [hvd.rank(), hvd.size(), config["value"]]
        """)
    )
    script = tmp_path / "run_example.py"
    header = "from train_module import train_fn\nconfig = {'value': 7}\n"
    script.write_text(header + block + "\nprint(results)\n")
    assert run(f"python {script}", tmp_path, timeout=120).strip().splitlines()[-1] == "[[0, 2, 7], [1, 2, 7]]"


def test_make_targets_install_and_run_what_they_say() -> None:
    """``make demo`` installs the examples extra (scikit-learn, tqdm), not ``[dev]`` with TensorFlow, Ray and
    Lightning; ``make check`` lints and runs the tests marked ``check``. ``make -n`` prints what a target would run
    without running it."""

    def planned(target: str) -> str:
        with tempfile.TemporaryDirectory() as empty:
            result = subprocess.run(
                ["make", "-n", "-f", str(REPO / "Makefile"), f"VENV={empty}/venv", target],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=30,
            )
        assert result.returncode == 0, result.stderr
        return result.stdout

    demo = planned("demo")
    assert "pip install --quiet -e '.[examples]'" in demo and "torch==2.13.0" in demo
    assert "[dev]" not in demo
    check = planned("check")
    assert "pip install --quiet -e '.[dev]'" in check and "ruff check" in check and "mypy" in check
    assert "pytest -m check" in check
