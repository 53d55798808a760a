"""Workers forked from a preloaded server (``shoalrun --preload``): which commands qualify, what is preloaded, and that
a forked worker is what a new interpreter would be (argv, path, directory, environment, streams, exit status,
session, thread count); then shoalrun end to end, with the server and without."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import PRELOAD_SERVER_ENV, SHOALRUN, clean_env, needs_netns, process_alive
from shoal.config import LAUNCHER_PID_ENV
from shoal.runner.forkserver import BorrowedServer, ForkServer, ForkServerError
from shoal.runner.forkserver_main import startup_env
from shoal.runner.preload import FRAMEWORK_MODULES, PythonCommand, preload_modules, python_command, top_level_imports
from shoal.runner.preload_server import DEFAULT_MODULES

pytestmark = [pytest.mark.check, pytest.mark.timeout(120)]


def test_only_this_interpreter_running_a_script_module_or_code_qualifies(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    env = dict(os.environ)
    python = sys.executable
    assert python_command([python, str(script), "--x", "1"], env) == PythonCommand("script", str(script), ("--x", "1"))
    assert python_command([python, "-u", "-m", "pkg.mod", "a"], env) == PythonCommand("module", "pkg.mod", ("a",))
    assert python_command([python, "-c", "print(2)", "b"], env) == PythonCommand("code", "print(2)", ("b",))
    bin_dir = os.path.dirname(python)
    env_on_path = {**env, "PATH": bin_dir}
    assert python_command([os.path.basename(python), str(script)], env_on_path) is not None  # found on PATH
    for refused in (
        [python, "-O", str(script)],  # an option the server's interpreter did not start with
        [python, "-m"],
        [python, str(tmp_path / "missing.py")],
        ["/bin/echo", str(script)],
        [],
    ):
        assert python_command(refused, env) is None, refused


def test_auto_preloads_the_frameworks_a_script_imports_at_its_top_level(tmp_path: Path) -> None:
    def modules(source: str, **env: str) -> tuple[str, ...]:
        return preload_modules("auto", PythonCommand("code", textwrap.dedent(source), ()), env)

    torch, tensorflow = FRAMEWORK_MODULES["torch"], FRAMEWORK_MODULES["tensorflow"]
    assert modules("import shoal.torch as hvd") == torch
    assert modules("from shoal import torch as hvd") == torch
    assert modules("import numpy\ntry:\n    import torch.nn as nn\nexcept ImportError:\n    pass") == torch
    assert modules("import horovod.tensorflow.keras as hvd") == tensorflow
    assert modules("import shoal.keras as hvd") == tensorflow
    assert modules("import keras", KERAS_BACKEND="torch") == torch
    assert modules("import keras", KERAS_BACKEND="jax") == ()
    assert modules("def main():\n    import torch\n") == ()  # only what the top level imports
    assert modules("import json") == ()
    assert preload_modules("none", PythonCommand("code", "import torch", ()), {}) == ()
    assert preload_modules("numpy, json", PythonCommand("code", "", ()), {}) == ("numpy", "json")
    # a module is read where python -m would find it, without importing its package
    assert "torch" in top_level_imports(PythonCommand("module", "shoal.bench.train", ()))


def _server(tmp_path: Path, **env: str) -> ForkServer:
    return ForkServer(["json"], {**clean_env(), **env})


def _read(process: object, timeout: float = 30) -> tuple[int, str, str]:
    code = process.wait(timeout=timeout)  # type: ignore[attr-defined]
    return code, process.stdout.read().decode(), process.stderr.read().decode()  # type: ignore[attr-defined]


def test_a_forked_worker_is_what_a_new_interpreter_would_be(tmp_path: Path) -> None:
    script = tmp_path / "job" / "show.py"
    script.parent.mkdir()
    script.write_text(
        textwrap.dedent(
            """
            import json, os, sys
            import random
            print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                              "var": os.environ.get("FORKED_VAR"), "pid": os.getpid(), "sid": os.getsid(0),
                              "launcher": os.environ.get(sys.argv[1]), "ppid": os.getppid(),
                              "random": random.random()}))
            print("to stderr", file=sys.stderr)
            sys.exit(3)
            """
        )
    )
    server = _server(tmp_path)
    try:
        seen = []
        for _ in range(2):
            env = {**clean_env(), "FORKED_VAR": "yes", LAUNCHER_PID_ENV: "1"}
            process = server.fork(PythonCommand("script", str(script), (LAUNCHER_PID_ENV,)), env, cwd=str(tmp_path))
            code, out, err = _read(process)
            assert code == 3 and err == "to stderr\n", (code, err)
            shown = json.loads(out)
            assert shown["argv"] == [str(script), LAUNCHER_PID_ENV] and shown["name"] == "__main__"
            assert shown["path0"] == str(script.parent) and shown["cwd"] == str(tmp_path)
            assert shown["var"] == "yes" and shown["pid"] == process.pid == shown["sid"]  # its own session
            assert shown["launcher"] == str(shown["ppid"]) == str(server.process.pid)  # it watches the server
            seen.append(shown["random"])
        assert seen[0] != seen[1]  # each fork draws its own random numbers

        module = server.fork(PythonCommand("module", "json.tool", ("--help",)), clean_env(), cwd=str(tmp_path))
        code, out, _ = _read(module)
        assert code == 0 and "usage:" in out
        inline = server.fork(PythonCommand("code", "import sys; print(sys.argv, sys.path[0] == '')", ("z",)), clean_env())
        assert _read(inline)[:2] == (0, "['-c', 'z'] True\n")
    finally:
        server.close()


def test_an_uncaught_exception_or_a_signal_ends_a_forked_worker_as_python_would(tmp_path: Path) -> None:
    server = _server(tmp_path)
    try:
        failing = server.fork(PythonCommand("code", "def f():\n    raise ValueError('boom')\nf()", ()), clean_env())
        code, _, err = _read(failing)
        assert code == 1 and "ValueError: boom" in err and 'File "<string>", line 3' in err
        assert "forkserver" not in err and "runpy" not in err  # the server's own frames are left out
        sleeper = server.fork(PythonCommand("code", "import time; time.sleep(60)", ()), clean_env())
        assert sleeper.poll() is None
        os.killpg(sleeper.pid, signal.SIGKILL)  # its own process group, as shoalrun signals a worker
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        interrupted = server.fork(PythonCommand("code", "raise KeyboardInterrupt", ()), clean_env())
        assert _read(interrupted)[0] == -signal.SIGINT
    finally:
        server.close()


def test_a_server_that_cannot_import_its_modules_says_so(tmp_path: Path) -> None:
    with pytest.raises(ForkServerError, match="cannot import no_such_module_here"):
        ForkServer(["no_such_module_here"], clean_env())


def test_a_worker_whose_start_up_environment_differs_is_not_forked(tmp_path: Path) -> None:
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    server = _server(tmp_path, PYTHONPATH=path)
    try:
        assert server.accepts({**clean_env(), "PYTHONPATH": path, "OTHER": "x"})
        assert not server.accepts({**clean_env(), "PYTHONPATH": "/elsewhere"})
        assert not server.accepts({**clean_env(), "PYTHONPATH": path, "LD_PRELOAD": "libx.so"})
    finally:
        server.close()


def test_what_an_argv_prefix_sets_in_the_servers_environment_every_worker_gets(tmp_path: Path) -> None:
    """An emulated host's prefix (``ip netns exec NS env GLOO_SOCKET_IFNAME=...``) sets variables for its workers."""
    server = ForkServer(["json"], clean_env(), prefix=["env", "FROM_PREFIX=veth1"])
    try:
        shown = server.fork(PythonCommand("code", "import os; print(os.environ['FROM_PREFIX'])", ()), clean_env())
        assert _read(shown)[:2] == (0, "veth1\n")
    finally:
        server.close()


_TORCH_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import shoal.torch as hvd
    hvd.init()
    print(json.dumps({"rank": hvd.rank(), "pid": os.getpid(), "ppid": os.getppid(), "threads": torch.get_num_threads(),
                      "sum": hvd.allreduce(torch.ones(2) * (hvd.rank() + 1), op=hvd.Sum).tolist()}))
    """
)


@pytest.mark.parametrize("preload", ["auto", "none"])
def test_shoalrun_forks_torch_workers_from_one_server_unless_told_not_to(tmp_path: Path, preload: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_TORCH_WORKER)
    env = {**clean_env(preload_server=False), "OMP_NUM_THREADS": "2"}
    argv = [*SHOALRUN, "--verbose", "--preload", preload, "-np", "2", sys.executable, str(script)]
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 0, err
    shown = [json.loads(line.split(":", 1)[1]) for line in out.splitlines() if "<stdout>:" in line]
    assert sorted(s["rank"] for s in shown) == [0, 1] and all(s["sum"] == [3.0, 3.0] for s in shown)
    assert all(s["threads"] == 2 for s in shown)  # the worker's OMP_NUM_THREADS, not the server's start-up count
    parents = {s["ppid"] for s in shown}
    if preload == "auto":
        assert "fork from a server that imported torch, torch.distributed, torch._dynamo" in err
        assert parents != {launcher.pid} and len(parents) == 1  # both forked by the one server
    else:
        assert "fork from a server" not in err and parents == {launcher.pid}


_SLEEPING_WORKER = (
    "import os, sys, time\nimport torch\nimport shoal.torch as hvd\nhvd.init()\n"
    "open(sys.argv[1] + f'/pid.{hvd.rank()}', 'w').write(f'{os.getpid()} {os.getppid()}')\ntime.sleep(120)\n"
)


def _sigkill_a_started_job(tmp_path: Path, *flags: str, env: dict[str, str]) -> dict[int, int]:
    """Start 2 sleeping workers under shoalrun with ``flags``, SIGKILL shoalrun once both have started, and return
    each worker's pid with its parent's and, under -1, that parent's parent (read before the kill), after checking
    that all of them ended within 15 s."""
    script = tmp_path / "worker.py"
    script.write_text(_SLEEPING_WORKER)
    argv = [*SHOALRUN, *flags, "-np", "2", sys.executable, str(script), str(tmp_path)]
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len([p for p in tmp_path.glob("pid.*") if p.read_text()]) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "the workers did not start"
            time.sleep(0.1)
        parents = dict(tuple(map(int, path.read_text().split())) for path in tmp_path.glob("pid.*"))
        grandparents = {_parent_of(parent) for parent in parents.values()}
        launcher.kill()
        launcher.wait(timeout=10)
        pids = {*parents, *parents.values()}
        deadline = time.monotonic() + 15
        while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if process_alive(pid)]
        assert launcher.pid not in pids  # each worker's parent is the fork server
        return {**parents, -1: grandparents.pop() if len(grandparents) == 1 else 0}
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_sigkill_of_shoalrun_ends_its_fork_server_and_forked_workers(tmp_path: Path) -> None:
    parents = _sigkill_a_started_job(tmp_path, env=clean_env(preload_server=False))
    assert len({parents[pid] for pid in parents if pid != -1}) == 1  # one server forked both


def _start_preload_server(path: Path, *args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "shoal.runner.preload_server", str(path), "--parent", str(os.getpid()), *args]
    server = subprocess.Popen(argv, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()  # said once the modules are imported and the socket listens
    assert "listening at" in line, line + (server.stderr.read() if server.stderr else "")
    return server


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_a_preload_server_forks_each_jobs_fork_server_and_refuses_what_it_did_not_preload(tmp_path: Path) -> None:
    """Two jobs in turn fork their workers from servers the preload server forked (not from one started by their
    shoalrun); a job whose workers preload other modules gets a server of its own; SIGTERM ends the preload server and
    removes its socket."""
    script = tmp_path / "worker.py"
    grandparent = '"grandparent": open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1], "sum"'
    script.write_text(_TORCH_WORKER.replace('"sum"', grandparent))
    socket_path = tmp_path / "preload.sock"
    server = _start_preload_server(socket_path)
    try:
        for job in range(2):
            argv = [*SHOALRUN, "--verbose", "--preload-server", str(socket_path), "-np", "2", sys.executable, str(script)]
            done = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=90)
            assert done.returncode == 0, done.stderr
            shown = [json.loads(line.split(":", 1)[1]) for line in done.stdout.splitlines() if "<stdout>:" in line]
            assert sorted(s["rank"] for s in shown) == [0, 1] and all(s["sum"] == [3.0, 3.0] for s in shown)
            assert f"fork from a server forked by {socket_path}" in done.stderr, done.stderr
            assert {int(s["grandparent"]) for s in shown} == {server.pid}, (job, shown)  # worker <- job server <- it
        other = [*SHOALRUN, "--verbose", "--preload", "json", "--preload-server", str(socket_path), "-np", "1"]
        other += [sys.executable, "-c", "print('ok')"]
        done = subprocess.run(other, env=clean_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "ok" in done.stdout, done.stderr
        assert "get a fork server of their own" in done.stderr and "fork from a server that imported json" in done.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=10) == 0
    assert not socket_path.exists()


_WHERE = """
import json, os
import torch  # so that shoalrun's --preload auto forks it
with open("/proc/net/dev") as dev:
    links = sorted(line.split(":")[0].strip() for line in dev.readlines()[2:])
grandparent = open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1]
print(json.dumps({"netns": os.stat("/proc/self/ns/net").st_ino, "links": links, "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
                  "grandparent": int(grandparent)}))
"""


@needs_netns
def test_a_preload_server_forks_emulated_hosts_servers_into_their_network_namespaces(tmp_path: Path) -> None:
    """``shoal.bench.netns`` with a preload server named: each emulated host's fork server is forked by it and enters
    that host's namespace, so a worker sees its host's link only (lo and its GLOO_SOCKET_IFNAME), in a namespace of
    its own; a namespace that is not there, or a name that is a path, is refused by name."""
    socket_path = tmp_path / "preload.sock"
    server = _start_preload_server(socket_path)
    script = tmp_path / "where.py"
    script.write_text(_WHERE)
    try:
        argv = [sys.executable, "-m", "shoal.bench.netns", "--hosts", "2", "--", sys.executable, str(script)]
        env = {**clean_env(), PRELOAD_SERVER_ENV: str(socket_path)}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stderr
        shown = [json.loads(line.split(":", 1)[1]) for line in done.stdout.splitlines() if "<stdout>:" in line]
        assert len(shown) == 2 and {s["grandparent"] for s in shown} == {server.pid}, shown  # worker <- job server <- it
        assert len({s["netns"] for s in shown} | {os.stat("/proc/self/ns/net").st_ino}) == 3, shown
        assert all(s["links"] == sorted(["lo", s["gloo"]]) for s in shown), shown
        modules = DEFAULT_MODULES.split(",")
        for name, said in (("shoal-no-such-host", "no network namespace 'shoal-no-such-host'"), ("../x", "not a network")):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with ours, theirs, pytest.raises(ForkServerError, match=said):
                BorrowedServer.ask(str(socket_path), theirs, modules, startup_env(clean_env()), 10.0, name)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=10) == 0


def test_sigkill_of_shoalrun_ends_a_fork_server_forked_by_a_preload_server(tmp_path: Path) -> None:
    """The job's server and workers end with the job as they do with a server of its own; the preload server stays."""
    server = _start_preload_server(tmp_path / "preload.sock")
    try:
        parents = _sigkill_a_started_job(tmp_path, "--preload-server", str(tmp_path / "preload.sock"), env=clean_env())
        assert len({parents[pid] for pid in parents if pid != -1}) == 1 and parents[-1] == server.pid
        assert server.poll() is None
    finally:
        server.kill()
        server.wait(timeout=10)


def test_a_preload_server_ends_with_the_process_it_was_given_as_parent(tmp_path: Path) -> None:
    socket_path = tmp_path / "preload.sock"
    parent = subprocess.Popen(["sleep", "60"])
    argv = [sys.executable, "-m", "shoal.runner.preload_server", str(socket_path), "--modules", "json"]
    server = subprocess.Popen([*argv, "--parent", str(parent.pid)], env=clean_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and "listening at" in server.stdout.readline()
        parent.kill()
        parent.wait()
        assert server.wait(timeout=10) == 0
        assert not socket_path.exists()
    finally:
        parent.kill()
        server.kill()
