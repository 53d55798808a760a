"""ElasticSampler resumes an epoch over a new world without repeating or skipping committed samples."""

from __future__ import annotations

from shoal.torch.elastic import ElasticSampler


def shard(dataset: list[int], world: int, state: dict[str, object] | None = None) -> list[ElasticSampler]:
    samplers = [ElasticSampler(dataset, shuffle=True, seed=3, num_replicas=world, rank=r) for r in range(world)]
    for sampler in samplers:
        if state is not None:
            sampler.load_state_dict(state)  # type: ignore[arg-type]
    return samplers


def test_shards_cover_the_epoch_disjointly() -> None:
    dataset = list(range(30))
    samplers = shard(dataset, 3)
    seen = [i for s in samplers for i in s]
    assert sorted(seen) == dataset and len(samplers[0]) == 10


def test_resume_after_a_worker_leaves_neither_repeats_nor_skips() -> None:
    dataset = list(range(60))
    three = shard(dataset, 3)
    for sampler in three:
        sampler.set_epoch(2)
    # Two committed batches of 4 on each of the three ranks: every rank records all three ranks' batches.
    for sampler in three:
        sampler.record_batch(0, 4)
        sampler.record_batch(1, 4)
    assert three[0].processed_indices == three[1].processed_indices == three[2].processed_indices
    committed = sorted(three[0].processed_indices)
    assert len(committed) == 24 and three[0].processed_count == 24
    assert committed == sorted(i for s in three for i in s.indices[:8])
    state = three[2].state_dict()
    two = shard(dataset, 2, state)
    rest = [i for s in two for i in s]
    assert sorted(rest) == sorted(set(dataset) - set(committed))  # exactly the unprocessed samples
    assert len(two[0]) == len(two[1]) == 18


def test_padding_keeps_ranks_in_step_when_uneven() -> None:
    samplers = shard(list(range(10)), 3)
    assert [len(s) for s in samplers] == [4, 4, 4]
    assert sorted(set(i for s in samplers for i in s)) == list(range(10))


def test_new_epoch_forgets_progress_and_reshuffles() -> None:
    sampler = ElasticSampler(list(range(20)), seed=1, num_replicas=1, rank=0)
    first = list(sampler)
    sampler.record_batch(0, 5)
    sampler.set_epoch(1)
    assert sampler.processed_indices == set() and len(sampler) == 20 and list(sampler) != first


def test_padding_is_not_counted_and_a_replay_is_visible() -> None:
    samplers = shard(list(range(10)), 3)  # 4 per rank: two padded positions
    samplers[0].record_batch(0, 4)
    assert samplers[0].processed_indices == set(range(10)) and samplers[0].processed_count == 10
    samplers[0].record_batch(0, 4)  # a step applied twice shows up as a count above the distinct samples
    assert samplers[0].processed_count == 20


def test_fewer_samples_left_than_ranks_still_gives_every_rank_a_batch() -> None:
    state = {"epoch": 0, "processed_indices": list(range(9)), "processed_count": 9}
    samplers = shard(list(range(10)), 4, state)
    assert [list(s) for s in samplers] == [[9], [9], [9], [9]]
