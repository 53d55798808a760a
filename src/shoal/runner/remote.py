"""Run a worker on a remote host under ssh, and kill its whole process tree when shoalrun goes away.

shoalrun keeps the ssh session's stdin open. ssh does not forward signals without a terminal, so this wrapper
watches stdin instead: when it closes (shoalrun ended the worker, or shoalrun itself died), the worker's process
group is terminated, then killed.

Usage (shoalrun builds this line): ``python -m shoal.runner.remote --env-from-stdin -- command ...``. With
``--env-from-stdin`` the first line of stdin is a JSON object of environment variables for the command (the job
secret among them): they never appear on a command line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

_GRACE_S = 2.0


def _end_group(child: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + _GRACE_S
        while time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
    # The group may outlive its leader; SIGKILL it once more to reach any grandchildren left behind.
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_line(fd: int) -> bytes:
    """The first line on ``fd``, without its newline, read byte by byte so that nothing past it is consumed."""
    data = bytearray()
    while True:
        byte = os.read(fd, 1)
        if not byte or byte == b"\n":
            return bytes(data)
        data += byte


def main(argv: list[str] | None = None) -> int:
    """Run the command after ``--``; returns its exit code (128+N when it died from signal N)."""
    args = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    if args[:1] == ["--env-from-stdin"]:
        args = args[1:]
        line = _read_line(sys.stdin.fileno())
        try:
            received = json.loads(line)
            if not isinstance(received, dict) or not all(isinstance(v, str) for v in received.values()):
                raise ValueError("expected a JSON object of strings")
        except ValueError as error:
            print(f"shoal.runner.remote: bad environment on stdin: {error}", file=sys.stderr)
            return 2
        env.update(received)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("shoal.runner.remote: no command given", file=sys.stderr)
        return 2
    child = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True, env=env)

    def watch_stdin() -> None:
        while os.read(sys.stdin.fileno(), 4096):
            pass
        _end_group(child)

    def on_signal(signum: int, _frame: object) -> None:
        _end_group(child)
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    threading.Thread(target=watch_stdin, daemon=True).start()
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
