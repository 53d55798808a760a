"""The fork server shoalrun starts on a host for that host's Python workers (``shoalrun --preload``).

It imports the frameworks the workers' script imports (torch, TensorFlow) once, then forks one child per worker
that shoalrun asks for. A child takes the worker's standard streams (passed over the control socket), its
environment and directory, starts a session of its own, and runs the script, the module or the code as ``python``
would. The server reports each child's pid when forked and its exit status when it ends. It ends when shoalrun
closes the control socket (or dies); children that are still running keep running and, like any worker, end
themselves when shoalrun is gone.

Run as ``python -m shoal.runner.forkserver_main FD MODULES``: FD is the inherited end of a ``SOCK_SEQPACKET``
socket pair, MODULES a comma-separated list. Only the standard library is imported before MODULES.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

_STDIO = 3
_MAX_RECORD = 1 << 22
"""The largest request (a worker's environment) a record may carry."""
_STARTUP_PREFIXES = ("PYTHON", "LD_")
"""Variables read when an interpreter starts (or a library loads)."""
_STARTUP_EXCEPT = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"})
"""...except these, which a forked worker applies itself (both servers and workers run unbuffered by default)."""


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode())


def not_ready(sock: socket.socket, error: str) -> None:
    """Tell the job on ``sock`` that this server cannot serve it, and why (it then starts its workers otherwise)."""
    _send(sock, {"ready": False, "error": error})


def reap(report: Callable[[int, int], None] | None = None) -> None:
    """Reap every child that has ended, passing ``report`` its pid and exit code."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if report is not None:
            report(pid, os.waitstatus_to_exitcode(status))


def wake_pipe() -> tuple[int, int]:
    """A non-blocking pipe that every signal writes to (``signal.set_wakeup_fd``), SIGCHLD included: a server's
    ``select`` on its read end wakes when a child ends. Returns (read, write)."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return wake_read, wake_write


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` a new interpreter reads at start-up (``PYTHON*``, ``LD_*``): a worker whose values differ
    from its server's starts afresh."""
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) and k not in _STARTUP_EXCEPT}


def preload(modules: list[str]) -> str | None:
    """Import ``modules``; returns what went wrong, or None."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as error:  # shoalrun starts its workers afresh instead, and says why when verbose
            return f"cannot import {name}: {type(error).__name__}: {error}"
    # What the preloaded modules made lives as long as every child: collections need not walk it again (a child's
    # full collection at shutdown would, for a second with TensorFlow loaded), and a child never writes to it.
    gc.collect()
    gc.freeze()
    return None


def serve(fd: int, modules: list[str]) -> dict[str, Any] | None:
    """Preload ``modules``, then fork a child per request until the control socket closes. Returns only in a child
    (its request) or at the end (None)."""
    sock = socket.socket(fileno=fd)
    started_with = dict(os.environ)  # shoalrun's, and what an argv prefix (``env NAME=VALUE``) laid over it
    error = preload(modules)
    if error is not None:
        not_ready(sock, error)
        return None
    return serve_job(sock, started_with)


def serve_job(sock: socket.socket, started_with: dict[str, str]) -> dict[str, Any] | None:
    """Say ready on ``sock``, then fork a child per request on it until it closes. Returns only in a child (its
    request) or at the end (None)."""
    wake_read, wake_write = wake_pipe()
    _send(sock, {"ready": True, "environ": started_with})
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_read], [], [])
        if wake_read in ready:
            drain(wake_read)
        reap(lambda pid, code: _send(sock, {"exit": pid, "code": code}))
        if sock.fileno() not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX_RECORD, _STDIO)
        if not data:  # shoalrun closed the socket, or is gone
            return None
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        settled, session_made = os.pipe()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for own in (wake_read, wake_write, settled):
                os.close(own)
            sock.close()
            os.setsid()  # its own session and process group, as shoalrun starts every worker
            os.close(session_made)
            for target, given in enumerate(fds):
                os.dup2(given, target)
            for given in fds:
                if given > 2:
                    os.close(given)
            return dict(request)
        for given in fds:
            os.close(given)
        os.close(session_made)
        os.read(settled, 1)  # returns once the child has its session: shoalrun may signal its group from the reply on
        os.close(settled)
        _send(sock, {"forked": pid})


NETNS_DIR = "/run/netns"
"""Where ``ip netns add NAME`` binds a network namespace."""
_CLONE_NEWNET = 0x40000000


def named_netns(name: str) -> str | None:
    """What is wrong with ``name`` as a namespace ``ip netns`` made (a path, or none bound), or None."""
    if not name or name in (".", "..") or not all(c.isalnum() or c in "_.-" for c in name):
        return f"{name!r} is not a network namespace's name"
    if not os.path.exists(os.path.join(NETNS_DIR, name)):
        return f"no network namespace {name!r} in {NETNS_DIR}"
    return None


def enter_netns(name: str) -> None:
    """Move this process into the network namespace ``ip netns`` named ``name``, as ``ip netns exec`` does for the
    command it starts (a single-threaded process: a forked child). Its children are born there.

    Raises:
        OSError: it is not there, or this process may not enter it (that takes CAP_SYS_ADMIN).
    """
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        setns = getattr(os, "setns", None)  # Python 3.12 and later
        if setns is not None:
            setns(fd, _CLONE_NEWNET)
            return
        import ctypes  # standard library; only where entering a namespace

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            number = ctypes.get_errno()
            raise OSError(number, f"setns into {name}: {os.strerror(number)}")
    finally:
        os.close(fd)


def drain(fd: int) -> None:
    """Read a non-blocking wake-up pipe empty."""
    while True:
        try:
            if not os.read(fd, 512):
                return
        except BlockingIOError:
            return


def _become(request: dict[str, Any]) -> None:
    """Take the worker's directory and environment (the server as its launcher), and undo what the fork inherited
    that a new interpreter would not have: the server's compute-thread count and numpy's global random state."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    watched = request.get("launcher_env")
    if watched and watched in os.environ:  # its launcher, whose exit it watches, is this server (which ends with shoalrun)
        os.environ[watched] = str(os.getppid())
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # a new interpreter seeds it from the OS (Python's random reseeds itself at fork)


def run(request: dict[str, Any]) -> None:
    """Run the worker's script, module or code as ``__main__``, as ``python`` would."""
    _become(request)
    kind, target, args = request["kind"], request["target"], list(request["args"])
    try:
        if kind == "script":
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            sys.argv = [target, *args]  # run_module puts the module's file in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as error:  # what python does with an uncaught exception, with no frames of ours
        trace = error.__traceback__
        while trace is not None and any(trace.tb_frame.f_globals is ours for ours in (globals(), vars(runpy))):
            trace = trace.tb_next
        sys.excepthook(type(error), error.with_traceback(trace), trace)
        if isinstance(error, KeyboardInterrupt):  # python ends killed by SIGINT then
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)


def main() -> None:
    fd, modules = int(sys.argv[1]), [name for name in sys.argv[2].split(",") if name]
    request = serve(fd, modules)
    if request is not None:
        run(request)


if __name__ == "__main__":
    main()
