"""The elastic pieces that need no training job: flag validation, discovery parsing, and round forming."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from shoal.exceptions import ElasticRendezvousError, WorkerRemovedError
from shoal.runner.cli import parse_args
from shoal.runner.discovery import HostDiscovery, run_discovery_script, script_source
from shoal.runner.hosts import HostSlots, HostSpecError
from shoal.runtime.elastic_rendezvous import REMOVED, ElasticKeys, join_round
from shoal.runtime.launch_env import SlotInfo

pytestmark = pytest.mark.check  # the quick tier: make check


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--min-np", "3", "-np", "2"], "-np 2 is smaller than --min-np 3"),
        (["--min-np", "2", "--max-np", "1"], "--max-np 1 is smaller"),
        (["--min-np", "0"], "--min-np must be >= 1"),
        (["--reset-limit", "-1", "-np", "2"], "--reset-limit must be >= 0"),
        (["--min-np", "1", "--elastic-timeout", "0"], "--elastic-timeout must be > 0"),
        (["--host-discovery-script", "x"], "needs -np or --min-np"),
        (["--host-discovery-script", "x", "-np", "1", "-H", "a:1"], "either --host-discovery-script or -H"),
    ],
)
def test_bad_elastic_flags_exit_2_with_one_line(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*flags, "python", "train.py"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def test_elastic_defaults() -> None:
    args = parse_args(["-np", "3", "--reset-limit", "2", "python", "t.py"])
    assert args.elastic and args.min_np == 3 and args.num_proc == 3 and args.elastic_timeout == 600
    args = parse_args(["--min-np", "2", "--host-discovery-script", "d.sh", "python", "t.py"])
    assert args.num_proc == 2 and args.max_np >= 2
    assert not parse_args(["-np", "2", "python", "t.py"]).elastic


def test_discovery_script_output_is_parsed(tmp_path: Path) -> None:
    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho 'a:2'\necho '# comment'\necho b\necho a:3\n")
    script.chmod(0o755)
    assert run_discovery_script(str(script)) == [HostSlots("a", 3), HostSlots("b", 1)]


@pytest.mark.parametrize(
    ("body", "message"),
    [("exit 3", "exited with code 3"), ("echo 'a:x'", "must be an integer"), ("sleep 5", "did not finish")],
)
def test_a_bad_discovery_script_is_reported(tmp_path: Path, body: str, message: str) -> None:
    script = tmp_path / "d.sh"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    with pytest.raises(HostSpecError, match=message):
        run_discovery_script(str(script), timeout_s=1)


def test_discovery_keeps_the_last_good_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("a:2\n")
    discovery = HostDiscovery([], script_source(f"cat {hosts}"), interval_s=0.05)
    discovery.start()
    assert discovery.hosts() == [HostSlots("a", 2)]
    hosts.unlink()
    assert not discovery.wait_for_slots(3, 0.3, excluded=set())
    assert discovery.hosts() == [HostSlots("a", 2)]
    hosts.write_text("a:2\nb:1\n")
    assert discovery.wait_for_slots(3, 5, excluded=set())
    assert not discovery.wait_for_slots(2, 0.1, excluded={"a"})
    discovery.stop()
    assert "keeping the previous host list" in capsys.readouterr().err


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _publish(store: dist.TCPStore, keys: ElasticKeys, round_number: int, members: dict[str, int], removed=()) -> None:  # type: ignore[no-untyped-def]
    for worker_id, rank in members.items():
        store.set(
            keys.assignment(round_number, worker_id), SlotInfo("h", rank, len(members), rank, len(members), 0, 1).to_json()
        )
    for worker_id in removed:
        store.set(keys.assignment(round_number, worker_id), REMOVED)
    store.set(keys.round, str(round_number))


def test_a_round_forms_once_every_member_arrives() -> None:
    store, keys = _store(), ElasticKeys("t")
    _publish(store, keys, 1, {"a": 0, "b": 1})
    results: dict[str, tuple[SlotInfo, int]] = {}

    def join(worker_id: str) -> None:
        results[worker_id] = join_round(store, keys, worker_id, 0, timeout_s=10)

    threads = [threading.Thread(target=join, args=(w,)) for w in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    assert results["a"] == (SlotInfo("h", 0, 2, 0, 2, 0, 1), 1) and results["b"][0].rank == 1
    assert store.get(keys.state(1)) == b"formed"


def test_a_round_missing_a_member_is_abandoned_for_the_next() -> None:
    store, keys = _store(), ElasticKeys("t")
    _publish(store, keys, 1, {"a": 0, "dead": 1})
    result: list[tuple[SlotInfo, int]] = []
    thread = threading.Thread(target=lambda: result.append(join_round(store, keys, "a", 0, timeout_s=10)))
    thread.start()
    while store.add(keys.arrived(1), 0) < 1:  # a has arrived in round 1 and waits for "dead"
        pass
    _publish(store, keys, 2, {"a": 0})
    thread.join(timeout=15)
    assert result == [(SlotInfo("h", 0, 1, 0, 1, 0, 1), 2)]
    assert store.get(keys.state(1)) == b"abandoned"


def test_a_removed_worker_is_told_and_a_missing_round_times_out() -> None:
    store, keys = _store(), ElasticKeys("t")
    _publish(store, keys, 1, {"a": 0}, removed=["b"])
    with pytest.raises(WorkerRemovedError):
        join_round(store, keys, "b", 0, timeout_s=5)
    with pytest.raises(ElasticRendezvousError, match="within 0 s"):
        join_round(store, keys, "a", 1, timeout_s=0.3)
