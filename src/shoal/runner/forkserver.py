"""Workers forked from a process that has already imported their framework (``shoalrun --preload``, on by default).

Every torch worker spends about 3 s of CPU importing torch and torch._dynamo before its first step (TensorFlow: 5 s),
and an elastic replacement pays it again before it can join. For the local workers of a Python command, shoalrun
instead starts one fork server per host (``shoal.runner.forkserver_main``) that imports those modules once
(``shoal.runner.preload`` says which), and forks each worker from it: a worker then starts in milliseconds, and its
host's cores train instead of importing. With ``--preload-server PATH``, a job on this host does not import them at
all: its fork server is forked from a long-lived preload server (``python -m shoal.runner.preload_server PATH``)
that imported them once for every job.

A worker is started afresh instead when its command cannot be forked (``shoal.runner.preload``), when its
environment differs from the server's in what Python or the dynamic loader read at start-up (``PYTHON*``, ``LD_*``),
and when the server could not import its modules (said with ``--verbose``). A forked worker is what a new
interpreter would be: its own session, streams, directory, environment, ``sys.argv``, ``sys.path[0]`` and
``__main__``, torch's thread count from its ``OMP_NUM_THREADS``, and fresh random seeds; what the preloaded
libraries read from the environment when imported, they read from the server's, which is the job's (or, from a
preload server, that server's).
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from shoal.runner.forkserver_main import startup_env
from shoal.runner.preload import PythonCommand

_BUFFER = 1 << 22


class ForkServerError(RuntimeError):
    """The fork server could not start, import its modules or fork a worker."""


@dataclass(frozen=True)
class Namespace:
    """A host emulated on this machine: the network namespace ``ip netns`` named ``name``, and the variables every
    worker there gets (``GLOO_SOCKET_IFNAME``: its shaped link)."""

    name: str
    environ: Mapping[str, str]

    def prefix(self) -> list[str]:
        """The argv prefix that starts a command there: ``ip netns exec NAME env K=V...``."""
        return ["ip", "netns", "exec", self.name, "env", *(f"{k}={v}" for k, v in self.environ.items())]


class ForkServer:
    """One fork server process and its control socket; ``fork`` starts a worker from it."""

    def __init__(
        self,
        modules: Sequence[str],
        env: Mapping[str, str],
        prefix: Sequence[str] = (),
        timeout: float = 120.0,
        preload_server: str | None = None,
        namespace: Namespace | None = None,
    ) -> None:
        """Start the server under ``prefix`` (an emulated host's ``ip netns exec``) with ``env``, and wait until it
        has imported ``modules``; or, with no prefix, have the preload server listening at ``preload_server`` fork
        one that has imported them already (in ``namespace``, an emulated host's, where one is given).

        Raises:
            ForkServerError: it could not start or import them within ``timeout`` seconds.
        """
        self.modules = tuple(modules)
        self.startup = startup_env(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for end in (ours, theirs):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)
        self.process: subprocess.Popen[bytes] | BorrowedServer
        try:
            if preload_server and not prefix:
                netns = None if namespace is None else namespace.name
                self.process = BorrowedServer.ask(preload_server, theirs, self.modules, self.startup, timeout, netns)
            else:
                argv = [*prefix, sys.executable, "-m", "shoal.runner.forkserver_main", str(theirs.fileno())]
                self.process = subprocess.Popen(
                    [*argv, ",".join(modules)],
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
        except OSError as error:
            ours.close()
            raise ForkServerError(f"cannot start the fork server: {error}") from error
        except ForkServerError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket = ours
        self._lock = threading.Lock()  # one fork at a time: its reply is the next "forked" record
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._ended: dict[int, int] = {}
        self._changed = threading.Condition()
        self.closed = False
        threading.Thread(target=self._read, name="shoal-forkserver", daemon=True).start()
        reply = self._reply(timeout)
        if not reply.get("ready"):
            self.close()
            raise ForkServerError(str(reply.get("error", "the fork server ended before it was ready")))
        borrowed = isinstance(self.process, BorrowedServer)
        if borrowed:
            self.overlay = {} if namespace is None else dict(namespace.environ)
        else:
            self.overlay = {k: v for k, v in reply["environ"].items() if env.get(k) != v}
        """What the prefix set in the server's environment (``env GLOO_SOCKET_IFNAME=...``), or the namespace's
        variables: every worker gets it."""

    def _read(self) -> None:
        while True:
            try:
                data = self._socket.recv(_BUFFER)
            except OSError:
                data = b""
            if not data:
                with self._changed:
                    self.closed = True
                    self._changed.notify_all()
                self._replies.put({"error": "the fork server ended"})
                return
            message = json.loads(data)
            if "exit" in message:
                with self._changed:
                    self._ended[int(message["exit"])] = int(message["code"])
                    self._changed.notify_all()
            else:
                self._replies.put(message)

    def _reply(self, timeout: float) -> dict[str, Any]:
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise ForkServerError(f"the fork server did not answer within {timeout:g} s") from None

    def accepts(self, env: Mapping[str, str]) -> bool:
        """Whether a worker with ``env`` may be forked from this server (it reads the same start-up variables)."""
        return not self.closed and startup_env(env) == self.startup

    def fork(self, command: PythonCommand, env: Mapping[str, str], cwd: str | None = None) -> ForkedProcess:
        """Fork a worker running ``command`` with ``env``; its stdout and stderr come back as pipes.

        Raises:
            ForkServerError: the server is gone, or the request could not be sent.
        """
        payload = json.dumps(command.request({**env, **self.overlay}, cwd or os.getcwd())).encode()
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            with self._lock:
                try:
                    socket.send_fds(self._socket, [payload], [null, out_write, err_write])
                except OSError as error:
                    raise ForkServerError(f"cannot reach the fork server: {error}") from error
                reply = self._reply(30.0)
        except BaseException:
            os.close(out_read)
            os.close(err_read)
            raise
        finally:
            for fd in (null, out_write, err_write):
                os.close(fd)
        if "forked" not in reply:
            os.close(out_read)
            os.close(err_read)
            raise ForkServerError(str(reply.get("error", "the fork server did not fork")))
        return ForkedProcess(self, int(reply["forked"]), os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb"))

    def exit_code(self, pid: int, timeout: float | None = 0.0) -> int | None:
        """``pid``'s exit status as ``Popen.returncode`` gives it, waiting up to ``timeout`` seconds (None: until it
        ends); None while it runs. 255 when the server ended before it could say (its status is lost)."""

        def known() -> int | None:
            if pid in self._ended:
                return self._ended[pid]
            if self.closed and not os.path.exists(f"/proc/{pid}"):
                return 255
            return None

        with self._changed:
            if timeout is None or timeout > 0:
                self._changed.wait_for(lambda: known() is not None or self.closed, timeout)
            return known()

    def close(self, timeout: float = 10.0) -> None:
        """End the server (its running workers go on); waits for it, then kills it."""
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ForkedProcess:
    """A worker forked by a ``ForkServer``, as the job supervises a ``Popen``: pid, pipes, ``poll``, ``wait`` and
    signals. It is the server's child, not shoalrun's: its exit status comes over the server's socket."""

    def __init__(self, server: ForkServer, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.server = server
        self.pid = pid
        self.args = [str(pid)]
        self.stdin: IO[bytes] | None = None
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout)
            if self.returncode is None and self.server.closed:  # its status may be lost: wait for it to go
                deadline = None if timeout is None else time.monotonic() + timeout
                while self.returncode is None and (deadline is None or time.monotonic() < deadline):
                    time.sleep(0.05)
                    self.returncode = self.server.exit_code(self.pid)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class BorrowedServer:
    """A job's fork server forked by a preload server (``shoal.runner.preload_server``), as ``ForkServer`` holds a
    ``Popen``: it is that server's child, not shoalrun's, so it is waited for through a pidfd."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid)

    @classmethod
    def ask(
        cls,
        path: str,
        theirs: socket.socket,
        modules: Sequence[str],
        startup: Mapping[str, str],
        timeout: float,
        netns: str | None = None,
    ) -> BorrowedServer:
        """Ask the preload server at ``path`` to fork a fork server for ``theirs`` (the job's end of its control
        socket) that has imported ``modules``, started as ``startup`` says, and enters the network namespace
        ``netns`` where one is named.

        Raises:
            ForkServerError: no preload server answers there, or it preloaded other modules or started otherwise.
        """
        if not hasattr(os, "pidfd_open"):
            raise ForkServerError("a preload server needs Linux 5.3 or later (pidfd)")
        request = json.dumps({"modules": list(modules), "startup": dict(startup), "netns": netns}).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as link:
                link.settimeout(timeout)
                link.connect(path)
                socket.send_fds(link, [request], [theirs.fileno()])
                reply = json.loads(link.recv(_BUFFER) or b"{}")
        except (OSError, ValueError) as error:
            raise ForkServerError(f"no preload server at {path}: {error}") from error
        if "pid" not in reply:
            raise ForkServerError(f"the preload server at {path} cannot serve this job: {reply.get('error')}")
        try:
            return cls(int(reply["pid"]))
        except OSError as error:  # the server it forked is gone already
            raise ForkServerError(f"the fork server from {path} ended at once: {error}") from error

    def wait(self, timeout: float | None = None) -> int:
        if not select.select([self._fd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
        return 0  # its status belongs to the preload server, which reaps it

    def kill(self) -> None:
        signal.pidfd_send_signal(self._fd, signal.SIGKILL)
