"""Process groups made with a connection bound (an elastic round's): creating one waits for a member's connection
only that long, and its collectives then keep their own, longer timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from shoal.comm import collectives, process_group, store
from shoal.runtime.launch_env import detect_launch
from shoal.testing import run_ranks


def _late_peers() -> tuple[float, float, float]:
    info = detect_launch(os.environ)
    scoped = store.prefix_store("bounded/", store.connect_store(info, 30.0))
    process_group.init_world(scoped, info.rank, info.size, 60.0, connect_timeout_s=1.0)
    ones = torch.ones(1)
    if info.rank == 1:
        time.sleep(3.0)  # three times the connection bound: only the collective's own timeout may apply
    started = time.monotonic()
    dist.all_reduce(ones)
    waited_world = time.monotonic() - started
    group = collectives.new_group([0, 1], 60.0, connect_timeout_s=1.0)
    if info.rank == 0:
        time.sleep(3.0)
    started = time.monotonic()
    dist.all_reduce(ones, group=group)
    waited_group = time.monotonic() - started
    process_group.destroy_world()
    return ones.item(), waited_world, waited_group


@pytest.mark.timeout(120)
def test_collectives_of_groups_made_with_a_connection_bound_wait_as_long_as_their_timeout() -> None:
    (total0, world0, _), (total1, _, group1) = run_ranks(_late_peers, 2, timeout_s=90)
    assert total0 == total1 == 4.0
    assert world0 > 2.5 and group1 > 2.5  # waited past the 1 s bound for the late peer, and completed


def _alone_in_a_pair() -> float:
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 (torch's error for a gloo rendezvous timeout varies by version)
        process_group.init_world(dist.HashStore(), 0, 2, 300.0, connect_timeout_s=1.0)  # rank 1 never comes
    process_group.destroy_world()
    return time.monotonic() - started


@pytest.mark.timeout(60)
def test_making_a_group_whose_member_never_comes_gives_up_at_the_connection_bound() -> None:
    (waited,) = run_ranks(_alone_in_a_pair, 1, timeout_s=45)
    assert waited < 10.0, waited  # not the 300 s timeout of its collectives
