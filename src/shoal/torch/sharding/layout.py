"""Which rank owns which elements of the parameters (ZeRO, arXiv 1910.02054): fixed buckets split into row blocks.

The parameters, in the order backward finishes them (the optimizer's order reversed), fill buckets of about
``bucket_bytes``; a bucket is the flat concatenation of its parameters. Each bucket splits into one block per rank as
the engine's reducescatter splits rows (``split_rows``: the first ranks take the remainder), so the block a rank
receives from a bucket's reduce-scatter is exactly the block it owns, and the allgather of every rank's block gives
the bucket back. A rank's shard of a param group is its blocks' pieces of that group's parameters, concatenated in
bucket order: the flat tensor its own optimizer steps.

The layout is fixed at construction (the optimizer state lives with it) and depends only on the parameters' sizes,
groups and the rank count, so every rank computes the same one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from shoal.engine.buffers import split_rows
from shoal.plan.memory import bucket_members


@dataclass(frozen=True)
class Piece:
    """A run of one parameter's elements that one rank owns: ``length`` elements from ``start`` of the parameter's
    flat view, at ``shard_start`` of that rank's shard of the parameter's group, at ``block_start`` of its block."""

    param: int
    """Index into the layout's parameters."""
    group: int
    start: int
    length: int
    shard_start: int
    block_start: int


@dataclass(frozen=True)
class Bucket:
    """Parameters reduced and gathered together: ``params`` (indices, in the order they are concatenated), each at
    ``offsets[i]`` of the flat bucket of ``numel`` elements; rank r's block is ``blocks[r]`` elements from
    ``sum(blocks[:r])``."""

    index: int
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    blocks: tuple[int, ...]

    def block_start(self, rank: int) -> int:
        """Where rank ``rank``'s block starts in the flat bucket."""
        return sum(self.blocks[:rank])

    def spans(self, rank: int, sizes: list[int]) -> Iterator[tuple[int, int, int, int]]:
        """Rank ``rank``'s block, parameter by parameter (``sizes``: every parameter's element count): (param,
        start in its flat view, length, start in the block)."""
        low = self.block_start(rank)
        high = low + self.blocks[rank]
        for param, offset in zip(self.params, self.offsets, strict=True):
            start, end = max(low, offset), min(high, offset + sizes[param])
            if start < end:
                yield param, start - offset, end - start, start - low


class ShardLayout:
    """The buckets over the parameters and, for one rank, the pieces it owns and the size of its shard per group.

    Args:
        sizes: each parameter's element count, in the optimizer's order.
        groups: each parameter's param-group index.
        element_bytes: bytes per element (the parameters share one dtype).
        bucket_bytes: a bucket closes once it holds this many bytes (0: one parameter per bucket).
        size: how many ranks share the state.
        rank: this rank's index among them.
    """

    __slots__ = (
        "bucket_bytes",
        "buckets",
        "element_bytes",
        "group_count",
        "groups",
        "pieces",
        "rank",
        "shard_sizes",
        "size",
        "sizes",
    )

    def __init__(
        self, sizes: list[int], groups: list[int], element_bytes: int, bucket_bytes: int, size: int, rank: int
    ) -> None:
        if len(sizes) != len(groups):
            raise ValueError("one group index per parameter is needed")
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not one of {size} ranks")
        self.sizes, self.groups = list(sizes), list(groups)
        self.element_bytes, self.bucket_bytes = element_bytes, bucket_bytes
        self.size, self.rank = size, rank
        self.group_count = max(groups, default=-1) + 1
        self.buckets = _fill_buckets(sizes, element_bytes, bucket_bytes, size)
        self.shard_sizes = [0] * self.group_count
        self.pieces: list[list[Piece]] = []
        """Per bucket, this rank's pieces in block order."""
        for bucket in self.buckets:
            owned = []
            for param, start, length, at in bucket.spans(rank, self.sizes):
                group = groups[param]
                owned.append(Piece(param, group, start, length, self.shard_sizes[group], at))
                self.shard_sizes[group] += length
            self.pieces.append(owned)

    def for_world(self, size: int, rank: int) -> ShardLayout:
        """The same parameters and buckets over another world (an elastic job that re-formed)."""
        return ShardLayout(self.sizes, self.groups, self.element_bytes, self.bucket_bytes, size, rank)

    @property
    def owned(self) -> int:
        """How many elements this rank owns, over every group."""
        return sum(self.shard_sizes)

    @property
    def total(self) -> int:
        """How many elements the parameters hold."""
        return sum(self.sizes)

    def owned_by(self, rank: int) -> int:
        """How many elements rank ``rank`` owns: the sum of its blocks."""
        return sum(bucket.blocks[rank] for bucket in self.buckets)

    def runs(self, first: int = 0, last: int | None = None) -> list[tuple[int, int, int, int]]:
        """Where every rank's blocks of buckets ``first`` to ``last`` (exclusive; default: every bucket), gathered
        one rank after another (each rank's in bucket order), land in the parameters: (param, start in its flat
        view, length, start in the gathered tensor), covering every element of those buckets once."""
        buckets = self.buckets[first:last]
        found = []
        gathered = 0
        for rank in range(self.size):
            for bucket in buckets:
                found += [(param, start, length, gathered + at) for param, start, length, at in bucket.spans(rank, self.sizes)]
                gathered += bucket.blocks[rank]
        return found

    def gather_chunks(self, max_elements: int) -> list[GatherChunk]:
        """The buckets in runs of about ``max_elements`` (whole buckets, at least one each), gathered one run at a
        time so that no rank holds more than two runs' gathered values at once."""
        chunks: list[GatherChunk] = []
        first, owned, numel = 0, 0, 0
        for index, bucket in enumerate(self.buckets):
            numel += bucket.numel
            if numel >= max_elements or index == len(self.buckets) - 1:
                mine = sum(bucket.blocks[self.rank] for bucket in self.buckets[first : index + 1])
                chunks.append(GatherChunk(owned, owned + mine, self.runs(first, index + 1)))
                first, owned, numel = index + 1, owned + mine, 0
        return chunks


@dataclass(frozen=True)
class GatherChunk:
    """A run of buckets gathered in one request: this rank's part of it (``owned_start`` to ``owned_stop`` of its
    blocks in bucket order) and where the gathered values land (``ShardLayout.runs``)."""

    owned_start: int
    owned_stop: int
    runs: list[tuple[int, int, int, int]]


def _fill_buckets(sizes: list[int], element_bytes: int, bucket_bytes: int, size: int) -> list[Bucket]:
    """Buckets over the parameters in backward order (the optimizer's order reversed), as
    ``shoal.plan.memory.bucket_members`` groups them."""
    order = list(reversed(range(len(sizes))))
    buckets: list[Bucket] = []
    for members in bucket_members([sizes[p] * element_bytes for p in order], bucket_bytes):
        params = [order[i] for i in members]
        offsets = [sum(sizes[q] for q in params[:k]) for k in range(len(params))]
        numel = sum(sizes[q] for q in params)
        buckets.append(Bucket(len(buckets), tuple(params), tuple(offsets), numel, tuple(split_rows(numel, size))))
    return buckets
