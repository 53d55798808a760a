"""A preload server: imports a framework once for every job on a host (``shoalrun --preload-server PATH``).

``shoalrun --preload`` already imports the framework once per job instead of once per worker: each job starts a fork
server that imports torch (about 3 s of CPU) and forks its workers from it. A host that runs many short jobs one
after another (a sweep, a test suite) still pays those 3 s per job. A preload server pays them once: it imports the
modules, listens on a Unix socket, and for each job that asks, forks a fork server that serves that job exactly as
its own would (it ends with the job, its workers watch it as their launcher). A job may name a network namespace
(``ip netns``, as ``shoal.bench.netns`` emulates hosts with): that fork server enters it before it serves the job, so
the job's workers are born there, as under ``ip netns exec`` (entering one takes root).

Run as ``python -m shoal.runner.preload_server PATH [--modules torch,torch.distributed,torch._dynamo] [--parent
PID]``. It serves a job whose workers would preload the same modules and whose start-up environment (``PYTHON*``,
``LD_*``) is its own, and refuses any other, which then starts its own fork server. What the preloaded modules read
from the environment when imported, they read from the preload server's. It ends on SIGTERM or SIGINT, or once
``--parent`` has exited, and removes its socket.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
from typing import Any

from shoal.runner.forkserver_main import (
    drain,
    enter_netns,
    named_netns,
    not_ready,
    preload,
    reap,
    run,
    serve_job,
    startup_env,
    wake_pipe,
)

DEFAULT_MODULES = "torch,torch.distributed,torch._dynamo"
_REQUEST = 1 << 20


def serve(path: str, modules: list[str], parent: int | None) -> dict[str, Any] | None:
    """Listen at ``path`` until told to end; fork a fork server for each job that asks. Returns a worker's request
    in a worker forked by one of those servers, and None in the preload server when it ends."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    startup = startup_env(os.environ)
    wake_read, wake_write = wake_pipe()
    ending: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _: ending.append(number))
    try:
        watched = [] if parent is None else [os.pidfd_open(parent)]  # readable once the parent has exited
    except ProcessLookupError:  # gone already
        watched, ending = [], [signal.SIGTERM]
    print(f"preload server: {', '.join(modules)} imported; listening at {path}", flush=True)
    while not ending:
        ready, _, _ = select.select([listener.fileno(), wake_read, *watched], [], [])
        if set(watched) & set(ready):
            break
        if wake_read in ready:
            drain(wake_read)
        reap()
        if listener.fileno() not in ready:
            continue
        link, _ = listener.accept()
        try:
            data, fds, _, _ = socket.recv_fds(link, _REQUEST, 1)
            request = json.loads(data)
        except (OSError, ValueError):
            link.close()
            continue
        netns = request.get("netns")
        refused = None if netns is None else named_netns(str(netns))
        if request.get("modules") != modules or request.get("startup") != startup or len(fds) != 1:
            refused = f"it preloaded {modules} and started with {startup}"
        if refused is not None:
            for fd in fds:
                os.close(fd)
            _answer(link, {"error": refused})
            continue
        pid = os.fork()
        if pid == 0:
            link.close()
            listener.close()
            for own in (wake_read, wake_write, *watched):
                os.close(own)
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            os.setsid()  # a job's server leaves with its job, not with a signal to the preload server's group
            job = socket.socket(fileno=fds[0])
            if netns is not None:  # an emulated host's: its workers are born in that host's namespace
                try:
                    enter_netns(str(netns))
                except OSError as error:
                    not_ready(job, f"cannot enter {netns}: {error}")
                    os._exit(0)
            worker = serve_job(job, dict(os.environ))
            if worker is None:  # the job closed its socket: this fork server's end
                os._exit(0)
            return worker
        os.close(fds[0])
        _answer(link, {"pid": pid})
    listener.close()
    os.unlink(path)
    return None


def _answer(link: socket.socket, reply: dict[str, Any]) -> None:
    try:
        link.sendall(json.dumps(reply).encode())
    except OSError:  # the job gave up asking; it starts its own server
        pass
    link.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shoal.runner.preload_server",
        description="Import a framework once and fork a fork server from it for each shoalrun job on this host that "
        "names PATH (shoalrun --preload-server PATH).",
    )
    parser.add_argument("path", help="the Unix socket to listen at (it must not exist)")
    parser.add_argument(
        "--modules",
        default=DEFAULT_MODULES,
        help="comma-separated modules to import: the same list a job's workers would preload (default: torch's, "
        "as shoalrun --preload auto gives for a torch script)",
    )
    parser.add_argument("--parent", type=int, help="end once this process has exited")
    args = parser.parse_args(argv)
    modules = [name for name in args.modules.split(",") if name]
    error = preload(modules)
    if error is not None:
        print(f"preload server: {error}", file=sys.stderr)
        return 1
    worker = serve(args.path, modules, args.parent)
    if worker is not None:
        run(worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
