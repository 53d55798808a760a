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
    # Two committed batches of 4 on each of the three ranks; the union is what a commit records.
    for sampler in three:
        sampler.record_batch(0, 4)
        sampler.record_batch(1, 4)
    committed = sorted(set().union(*(s.processed_indices for s in three)))
    assert len(committed) == 24
    state = {"epoch": 2, "processed_indices": committed}
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
