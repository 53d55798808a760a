"""Workers forked from a process that has already imported their framework (``shoalrun --preload``, on by default).

Every torch worker spends about 3 s of CPU importing torch and torch._dynamo before its first step (TensorFlow: 5 s),
and an elastic replacement pays it again before it can join. For the local workers of a Python command, shoalrun
instead starts one fork server per host (``shoal.runner.forkserver_main``) that imports those modules once, and forks
each worker from it: a worker then starts in milliseconds, and its host's cores train instead of importing.

What is preloaded: ``--preload auto`` (the default) reads the script's (or module's, or ``-c`` code's) top-level
imports and preloads torch for torch, Lightning and ``shoal.torch``/``horovod.torch``, TensorFlow for TensorFlow,
tf_keras and ``shoal.tensorflow``/``shoal.keras`` (Keras follows ``KERAS_BACKEND``); nothing, and no server, for
anything else. ``--preload MODULES`` names them; ``--preload none`` starts every worker afresh.

A worker is started afresh instead when its command is not this Python interpreter running a script, ``-m`` module
or ``-c`` code (with at most ``-u``), when its environment differs from the server's in what Python or the dynamic
loader read at start-up (``PYTHON*``, ``LD_*``), and when the server could not import its modules (said with
``--verbose``). A forked worker is what a new interpreter would be: its own session, streams, directory,
environment, ``sys.argv``, ``sys.path[0]`` and ``__main__``, torch's thread count from its ``OMP_NUM_THREADS``, and
fresh random seeds; what the preloaded libraries read from the environment when imported, they read from the
server's, which is the job's.
"""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from shoal.config import LAUNCHER_PID_ENV

FRAMEWORK_MODULES = {
    "torch": ("torch", "torch.distributed", "torch._dynamo"),
    "tensorflow": ("tensorflow",),
}
"""What preloading a framework imports: torch._dynamo too, which torch imports the first time an optimizer steps."""
_FRAMEWORK_OF = {
    "torch": "torch",
    "lightning": "torch",
    "pytorch_lightning": "torch",
    "shoal.torch": "torch",
    "horovod.torch": "torch",
    "tensorflow": "tensorflow",
    "tf_keras": "tensorflow",
    "shoal.tensorflow": "tensorflow",
    "horovod.tensorflow": "tensorflow",
}
_KERAS = ("keras", "shoal.keras", "horovod.keras")
_STARTUP_PREFIXES = ("PYTHON", "LD_")
"""Variables read when an interpreter starts (or a library loads): a worker whose values differ starts afresh."""
_STARTUP_EXCEPT = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"})
"""...except these, which a forked worker applies itself (both servers and workers run unbuffered by default)."""
_BUFFER = 1 << 22


@dataclass(frozen=True)
class PythonCommand:
    """A worker command this interpreter can run from a fork server: ``kind`` is script, module or code."""

    kind: str
    target: str
    args: tuple[str, ...]

    def request(self, env: Mapping[str, str], cwd: str) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "target": self.target,
            "args": list(self.args),
            "env": dict(env),
            "cwd": cwd,
            "launcher_env": LAUNCHER_PID_ENV,
        }


def python_command(command: Sequence[str], env: Mapping[str, str]) -> PythonCommand | None:
    """``command`` as a script, module or code run by this interpreter (``sys.executable``, or another name for it in
    the same directory); None when it is anything else, or passes the interpreter options other than ``-u``."""
    if not command:
        return None
    found = command[0] if os.sep in command[0] else _which(command[0], env)
    if found is None or not _same_interpreter(found):
        return None
    rest = list(command[1:])
    while rest[:1] == ["-u"]:
        rest.pop(0)
    if not rest:
        return None
    first = rest[0]
    if first in ("-m", "-c"):
        if len(rest) < 2:
            return None
        return PythonCommand("module" if first == "-m" else "code", rest[1], tuple(rest[2:]))
    if first.startswith("-") or not os.path.isfile(first):
        return None
    return PythonCommand("script", first, tuple(rest[1:]))


def _which(name: str, env: Mapping[str, str]) -> str | None:
    return shutil.which(name, path=env.get("PATH"))


def _same_interpreter(path: str) -> bool:
    """The same executable, found in the same directory (a virtual environment's ``python`` is a link to the base
    interpreter, with other packages)."""
    ours = os.path.abspath(sys.executable)
    theirs = os.path.abspath(path)
    try:
        return os.path.dirname(theirs) == os.path.dirname(ours) and os.path.samefile(theirs, ours)
    except OSError:
        return False


def preload_modules(setting: str, command: PythonCommand, env: Mapping[str, str]) -> tuple[str, ...]:
    """What the fork server imports for ``command`` under ``--preload setting``: nothing for ``none``, the named
    modules, or (``auto``) the modules of the frameworks its top-level imports name."""
    if setting == "none":
        return ()
    if setting != "auto":
        return tuple(name.strip() for name in setting.split(",") if name.strip())
    frameworks: set[str] = set()
    for name in top_level_imports(command):
        parts = name.split(".")
        for prefix in (".".join(parts[:end]) for end in range(len(parts), 0, -1)):  # the longest known prefix
            if prefix in _KERAS:
                frameworks |= {env.get("KERAS_BACKEND", "tensorflow")} & set(FRAMEWORK_MODULES)
                break
            if prefix in _FRAMEWORK_OF:
                frameworks.add(_FRAMEWORK_OF[prefix])
                break
    return tuple(module for framework in sorted(frameworks) for module in FRAMEWORK_MODULES[framework])


def top_level_imports(command: PythonCommand) -> set[str]:
    """The modules a script's, module's or code's top level imports (also under ``if``, ``try`` and ``with``; not
    inside functions), each also with its ``from`` names (``from shoal import torch`` gives ``shoal.torch``); empty
    when the source cannot be found or read."""
    source = command.target if command.kind == "code" else _source_of(command)
    if source is None:
        return set()
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []):
                    pending.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return names


def _source_of(command: PythonCommand) -> str | None:
    path = command.target if command.kind == "script" else _module_file(command.target)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as source:
            return source.read()
    except (OSError, UnicodeDecodeError):
        return None


def _module_file(name: str) -> str | None:
    """Where ``python -m name`` would find its source, searched from the working directory without importing any
    package on the way (a package runs its ``__main__``)."""
    search: list[str] | None = [os.getcwd(), *sys.path]
    spec = None
    for part in name.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    if spec is not None and spec.submodule_search_locations:
        spec = importlib.machinery.PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") else None


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` a new interpreter reads at start-up."""
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) and k not in _STARTUP_EXCEPT}


class ForkServerError(RuntimeError):
    """The fork server could not start, import its modules or fork a worker."""


class ForkServer:
    """One fork server process and its control socket; ``fork`` starts a worker from it."""

    def __init__(
        self, modules: Sequence[str], env: Mapping[str, str], prefix: Sequence[str] = (), timeout: float = 120.0
    ) -> None:
        """Start the server under ``prefix`` (an emulated host's ``ip netns exec``) with ``env``, and wait until it
        has imported ``modules``.

        Raises:
            ForkServerError: it could not start or import them within ``timeout`` seconds.
        """
        self.modules = tuple(modules)
        self.startup = startup_env(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for end in (ours, theirs):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)
        argv = [*prefix, sys.executable, "-m", "shoal.runner.forkserver_main", str(theirs.fileno()), ",".join(modules)]
        try:
            self.process = subprocess.Popen(
                argv,
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
        self.overlay = {k: v for k, v in reply["environ"].items() if env.get(k) != v}
        """What the prefix set in the server's environment (``env GLOO_SOCKET_IFNAME=...``): every worker gets it."""

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
