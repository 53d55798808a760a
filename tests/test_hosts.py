"""Host lists, hostfiles and slot assignment (pure functions, no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.runner.hosts import HostSlots, HostSpecError, assign_slots, is_local_host, parse_hostfile, parse_hosts

pytestmark = pytest.mark.check  # the quick tier: make check


def test_parse_hosts_with_and_without_slots() -> None:
    assert parse_hosts("a:4,b:2,c") == [HostSlots("a", 4), HostSlots("b", 2), HostSlots("c", 1)]


@pytest.mark.parametrize("spec", ["", "a:x", "a:0", "a:-1", "a:1:2", ":3", "a,,b", "a b:2", "a:1,a:2"])
def test_parse_hosts_rejects_bad_lists(spec: str) -> None:
    with pytest.raises(HostSpecError):
        parse_hosts(spec)


def test_parse_hostfile(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode1 slots=2\nnode2:3  # two more\n\nnode3\n")
    assert parse_hostfile(str(path)) == [HostSlots("node1", 2), HostSlots("node2", 3), HostSlots("node3", 1)]


def test_parse_hostfile_errors(tmp_path: Path) -> None:
    with pytest.raises(HostSpecError, match="cannot read"):
        parse_hostfile(str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.write_text("node1 slots=two\n")
    with pytest.raises(HostSpecError, match="line 1"):
        parse_hostfile(str(bad))
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(HostSpecError, match="no hosts"):
        parse_hostfile(str(empty))


def test_assign_slots_fills_hosts_in_order_with_horovod_cross_ranks() -> None:
    slots = assign_slots([HostSlots("a", 2), HostSlots("b", 3)], 4)
    assert [(s.hostname, s.rank, s.local_rank, s.local_size) for s in slots] == [
        ("a", 0, 0, 2),
        ("a", 1, 1, 2),
        ("b", 2, 0, 2),
        ("b", 3, 1, 2),
    ]
    assert [(s.cross_rank, s.cross_size) for s in slots] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_assign_slots_uneven_hosts() -> None:
    slots = assign_slots([HostSlots("a", 3), HostSlots("b", 1)], 4)
    # local rank 0 lives on both hosts; local ranks 1 and 2 only on host a.
    assert [(s.local_rank, s.cross_rank, s.cross_size) for s in slots] == [(0, 0, 2), (1, 0, 1), (2, 0, 1), (0, 1, 2)]


def test_assign_slots_rejects_too_many_processes() -> None:
    with pytest.raises(HostSpecError, match="larger than the 3 slots"):
        assign_slots([HostSlots("a", 2), HostSlots("b", 1)], 4)


def test_local_host_detection() -> None:
    assert is_local_host("localhost")
    assert is_local_host("127.0.0.1")
    assert not is_local_host("127.0.0.2")
    assert not is_local_host("no-such-host.invalid")
