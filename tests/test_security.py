"""A job that no stranger can join, read or steer: the authenticated store, secrets off command lines, safe ssh
destinations, shared-memory paths that cannot be redirected, and negotiation without pickle."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shoal.torch as hvd
from conftest import REPO, SHOALRUN, clean_env
from shoal.comm import auth_store, shm, store_client, store_wire, torch_store
from shoal.engine.request import Kind, RequestMeta
from shoal.engine.wire_format import decode_requests, decode_stall_report, encode_requests
from shoal.testing import run_ranks

# ----- the store -----


def _stranger_attacks() -> dict[str, object]:
    """Rank 0 plays a stranger who knows the store's address but not the secret, then checks the job still works."""
    hvd.init()
    outcome: dict[str, object] = {}
    if hvd.rank() == 0:
        addr, port = os.environ["SHOAL_RENDEZVOUS_ADDR"], int(os.environ["SHOAL_RENDEZVOUS_PORT"])
        # 1. torch's own TCPStore client.
        attempts = []
        try:
            client = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=3), wait_for_workers=False)
            for name, action in (
                ("set", lambda: client.set("stranger", "was here")),
                ("get", lambda: client.get("x")),
                ("list_keys", client.list_keys),
                ("num_keys", client.num_keys),
            ):
                try:
                    attempts.append((name, repr(action())))
                except Exception as error:  # what a stranger gets: an error, never data
                    attempts.append((name, f"error: {type(error).__name__}"))
        except Exception as error:
            attempts.append(("connect", f"error: {type(error).__name__}"))
        outcome["tcpstore"] = attempts
        # 2. Raw garbage: the server answers with its greeting and challenge only, then hangs up.
        replies = []
        for garbage in (os.urandom(4096), b"\x00" * 64 + b"\xff" * 64, b"GET / HTTP/1.1\r\n\r\n" * 8):
            with socket.create_connection((addr, port), timeout=5) as sock:
                sock.sendall(garbage)
                received = b""
                sock.settimeout(5)
                try:
                    while chunk := sock.recv(4096):
                        received += chunk
                except OSError:
                    pass
                replies.append(len(received))
        outcome["garbage_replies"] = replies
        # 3. Shoal's own client with a wrong secret.
        try:
            store_client.connect(addr, port, "not-the-secret", timeout_s=3)
            outcome["wrong_secret"] = "connected"
        except auth_store.StoreAuthError as error:
            outcome["wrong_secret"] = str(error)
        from shoal.runtime import context

        outcome["stranger_key_written"] = context.current().job_store.check(["stranger"])
    outcome["sum"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()
    hvd.shutdown()
    hvd.init()  # the store still serves the job after the attacks
    outcome["sum_after_reinit"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()
    return outcome


def test_a_stranger_can_neither_read_list_nor_write_the_store_and_the_job_goes_on() -> None:
    results = run_ranks(_stranger_attacks, 2, timeout_s=90)
    stranger = results[0]
    assert all(result.startswith("error") for _, result in stranger["tcpstore"]), stranger["tcpstore"]  # type: ignore[union-attr]
    greeting = len(store_wire.MAGIC) + store_wire.NONCE_BYTES
    assert all(0 <= n <= greeting for n in stranger["garbage_replies"])  # type: ignore[union-attr]  # the challenge at most
    assert "does not match the job's secret" in stranger["wrong_secret"]  # type: ignore[operator]
    assert stranger["stranger_key_written"] is False
    for result in results:
        assert result["sum"] == result["sum_after_reinit"] == [2.0, 2.0]


def test_a_server_without_the_secret_is_refused_by_clients() -> None:
    """A process squatting on the port cannot pose as the job's store: it cannot answer the client's challenge."""
    impostor = auth_store.AuthStoreServer("some-other-secret")
    try:
        with pytest.raises(auth_store.StoreAuthError):
            store_client.connect("127.0.0.1", impostor.port, "the-job-secret", timeout_s=3)
    finally:
        impostor.close()


def test_the_store_keeps_torch_store_semantics() -> None:
    server = auth_store.AuthStoreServer("s3cret")
    try:
        client = store_client.connect("127.0.0.1", server.port, "s3cret", timeout_s=5)
        client.set("a", b"1")
        assert client.get("a") == b"1" and client.add("n", 2) == 2 and client.add("n", 3) == 5
        assert client.compare_set("c", "", "x") == b"x" and client.compare_set("c", "y", "z") == b"x"
        assert client.check(["a", "n"]) and not client.check(["a", "missing"])
        with pytest.raises(dist.DistStoreError):
            client.wait(["missing"], timedelta(milliseconds=200))
        view = client.with_prefix("p/")
        view.set("k", "v")
        assert client.get("p/k") == b"v" and server.local_view().get("p/k") == b"v"
        assert client.delete_key("a") and not client.check(["a"])
    finally:
        server.close()


@contextlib.contextmanager
def _round_view(connect: Callable[..., Any], timeout_s: float, reason: str) -> Iterator[tuple[Any, Any]]:
    """A client of a fresh store and its view under ``round/`` whose abort check gives ``reason`` once the client
    has set ``broken``."""
    server = auth_store.AuthStoreServer("s3cret")
    try:
        client = connect("127.0.0.1", server.port, "s3cret", timeout_s=timeout_s)
        yield client, client.with_prefix("round/", abort=lambda: reason if client.check(["broken"]) else None)
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_a_wait_with_an_abort_check_ends_with_its_reason_and_a_key_that_comes_still_arrives() -> None:
    with _round_view(store_client.connect, 30, "gone") as (client, view):
        threading.Timer(1.5, client.set, ("round/late", b"v")).start()
        assert view.get("late") == b"v"  # several abort checks pass before the key comes
        threading.Timer(1.5, client.set, ("broken", b"worker#2")).start()
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="gone"):
            view.with_prefix("pg/").wait(["never"])  # the abort check is inherited by views made from it
        assert time.monotonic() - started < 1.5 + 2 * store_client.ABORT_POLL_S + 1.0
        with pytest.raises(dist.DistStoreError, match="gone"):
            view.get("never")


@pytest.mark.timeout(60)
def test_gloo_stops_joining_a_group_when_the_store_says_a_peer_will_never_come() -> None:
    """torch's gloo waits for its peers' addresses in Shoal's store; an abort there fails the group's creation."""
    with _round_view(torch_store.connect, 300, "rank 1 died") as (client, view):
        threading.Timer(1.0, client.set, ("broken", b"1")).start()
        started = time.monotonic()
        with pytest.raises(Exception, match="rank 1 died"):
            dist.ProcessGroupGloo(view, 0, 2, timedelta(seconds=300))  # rank 1 never writes its address
        assert time.monotonic() - started < 10


# ----- no secret on any command line -----

_PRINT_SECRET = "import os, time; print('secret', os.environ['SHOAL_SECRET'], flush=True); time.sleep(3)"


def _secret_in_command_lines(secret: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if secret.encode() in cmdline:
                found.append(cmdline.replace(b"\0", b" ").decode(errors="replace")[:200])
    return found


def _run_and_scan(args: list[str]) -> tuple[int, list[str], set[str]]:
    process = subprocess.Popen(
        [*SHOALRUN, *args, sys.executable, "-c", _PRINT_SECRET],
        env=clean_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    secrets_seen: set[str] = set()
    exposed: list[str] = []
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "secret " in line:
            secret = line.split("secret ", 1)[1].strip()
            secrets_seen.add(secret)
            exposed += _secret_in_command_lines(secret)  # while every process of the job is alive
    code = process.wait(timeout=120)
    assert code == 0, "".join(lines[-20:])
    return code, exposed, secrets_seen


def test_no_command_line_of_a_local_job_holds_the_secret() -> None:
    _, exposed, secrets_seen = _run_and_scan(["-np", "2"])
    assert len(secrets_seen) == 1 and exposed == []


def test_no_command_line_of_an_ssh_job_holds_the_secret(loopback_sshd: tuple[int, Path]) -> None:
    port, key = loopback_sshd
    args = [
        "-np",
        "2",
        "-H",
        "localhost:1,127.0.0.2:1",
        "-p",
        str(port),
        "-i",
        str(key),
        "--ssh-strict-host-key-checking",
        "no",
        "--start-timeout",
        "60",
    ]
    _, exposed, secrets_seen = _run_and_scan(args)
    assert len(secrets_seen) == 1 and exposed == []  # the remote worker got the secret, through stdin


# ----- ssh destinations -----


@pytest.mark.parametrize("where", ["hostfile", "discovery"])
def test_a_host_named_like_an_ssh_option_is_refused_before_anything_runs(tmp_path: Path, where: str) -> None:
    marker = tmp_path / "proxy-ran"
    proxy = tmp_path / "proxy.sh"
    proxy.write_text(f"#!/bin/sh\ntouch {marker}\n")
    proxy.chmod(0o755)
    hostile = f"-oProxyCommand={proxy}"
    if where == "hostfile":
        hostfile = tmp_path / "hosts"
        hostfile.write_text(f"{hostile} slots=1\n")
        args = ["-np", "1", "--hostfile", str(hostfile)]
    else:
        script = tmp_path / "discover.sh"
        script.write_text(f"#!/bin/sh\necho '{hostile}:1'\n")
        script.chmod(0o755)
        args = ["-np", "1", "--host-discovery-script", str(script), "--elastic-timeout", "3"]
    result = subprocess.run(
        [*SHOALRUN, *args, sys.executable, "-c", "print('ran')"], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "invalid host name '-oProxyCommand=" in result.stderr, result.stderr[-2000:]
    assert "ran" not in result.stdout and not marker.exists()


# ----- shared memory -----


def test_a_tampered_shared_memory_path_in_the_store_is_refused(tmp_path: Path) -> None:
    token, host_key = "abcdef012345", "node-a"
    host = hashlib.sha256(host_key.encode()).hexdigest()[:8]
    target = tmp_path / "victim"
    target.write_bytes(b"\0" * (1 << 20))
    link = f"/dev/shm/{shm.SEGMENT_PREFIX}{token}-{host}-deadbeef"
    wrong_size = f"/dev/shm/{shm.SEGMENT_PREFIX}{token}-{host}-0badf00d"
    os.symlink(target, link)
    Path(wrong_size).write_bytes(b"\0" * 4096)
    try:
        for planted, reason in (
            (str(target), "not this job's segment"),
            ("/dev/shm/../etc/passwd", "not this job's"),
            (link, "Too many levels of symbolic links"),
            (wrong_size, "holds 4096 bytes"),
        ):
            store = dist.HashStore()
            store.set(f"shm/engine/{host}", planted)
            with pytest.raises(shm.SharedMemoryError, match=reason):
                shm.create_local_group(store, 1, 2, host_key, token, slot_bytes=4096, timeout_s=5)
            assert store.check([f"shm/engine/{host}/refused/1"])  # the others learn it at once, nobody waits
        assert target.read_bytes() == b"\0" * (1 << 20)
    finally:
        os.unlink(link)
        os.unlink(wrong_size)


# ----- negotiation without pickle -----


def test_negotiation_messages_round_trip_and_garbage_is_refused() -> None:
    metas = [
        RequestMeta("grad.0", Kind.ALLREDUCE, 0, "float32", (3, 4), 0, None, 1.0, 0.5, None, "cuda", None),
        RequestMeta("set", Kind.ADD_PROCESS_SET, 0, payload=(0, 2)),
    ]
    assert decode_requests(encode_requests(metas), 1) == metas
    import pickle

    for garbage in (
        pickle.dumps(metas),
        b"[1, 2]",
        b'[["x", "nope", 0, "", [], null, null, 1, 1, null, "cpu", null]]',
        b'[["x", "allreduce", 0, "f", [-1], null, null, 1, 1, null, "cpu", null]]',
        b"{" * 100000,
    ):
        with pytest.raises(ValueError, match="malformed negotiation message from rank 3"):
            decode_requests(garbage, 3)
    with pytest.raises(ValueError, match="malformed stall report from rank 2"):
        decode_stall_report(b'[[0, "t", "soon"]]', 2)


def test_the_store_survives_many_garbage_connections() -> None:
    server = auth_store.AuthStoreServer("s3cret")
    try:
        for _ in range(50):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                sock.sendall(os.urandom(100))
        deadline = time.monotonic() + 10
        while server.refused < 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.refused == 50
        client = store_client.connect("127.0.0.1", server.port, "s3cret", timeout_s=5)
        client.set("still", "serving")
        assert client.get("still") == b"serving"
    finally:
        server.close()
