"""Reduce-scatter and allgather of uneven blocks through one host's shared memory (``SharedMemoryGroup``'s slots).

What a sharded optimizer (ZeRO) runs every step: each local rank receives the sum of its own block of a flat tensor
(``reduce_scatter_``), and later every rank receives every rank's updated block (``allgather_blocks``). Against the
allreduce these save the half a rank does not need: a reduce-scatter copies into shared memory only the blocks the
other ranks own and reads only its own block of theirs (about 2(N-1)/N bytes of memory traffic per byte, against
about 4 for the allreduce); the allgather writes a rank's block once and reads the others'.

The slots alternate halves from one step to the next (``SharedMemoryGroup.next_slots``), so one barrier per step is
enough: a rank writes a half again only after a barrier that every peer reached after reading it.
"""

from __future__ import annotations

import torch

from shoal.comm.reductions import REDUCE_INTO, REDUCE_OUT
from shoal.comm.shm import SharedMemoryGroup


def block_bounds(counts: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of each rank's block when blocks of ``counts`` elements follow one another."""
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def reduce_scatter_(group: SharedMemoryGroup, flat: torch.Tensor, reduction: str, counts: list[int]) -> torch.Tensor:
    """Reduce a contiguous 1-D CPU tensor, the same size on every local rank, and return this rank's block of the
    result (a new tensor): rank r's block is ``counts[r]`` elements after the blocks of the ranks before it."""
    if sum(counts) != flat.numel() or len(counts) != group.local_size:
        raise ValueError(f"blocks {counts} do not split {flat.numel()} elements over {group.local_size} ranks")
    me = group.local_rank
    low, high = block_bounds(counts)[me]
    output = torch.empty(high - low, dtype=flat.dtype)
    peers = [rank for rank in range(group.local_size) if rank != me]
    step = group.chunk_elements(flat.dtype)
    for offset in range(0, flat.numel(), step):
        end = min(offset + step, flat.numel())
        slots = group.next_slots(flat.dtype)
        mine = slots[me]
        # Only what the peers own goes into shared memory: this rank reads its own block from its tensor.
        start, stop = max(low, offset), min(high, end)
        if start < stop:
            mine[: start - offset].copy_(flat[offset:start])
            mine[stop - offset : end - offset].copy_(flat[stop:end])
        else:
            mine[: end - offset].copy_(flat[offset:end])
        group.barrier()
        if start < stop and peers:
            target = output[start - low : stop - low]
            first = slots[peers[0]][start - offset : stop - offset]
            REDUCE_OUT[reduction](flat[start:stop], first, target)
            for rank in peers[1:]:
                REDUCE_INTO[reduction](target, slots[rank][start - offset : stop - offset])
        elif start < stop:
            output[start - low : stop - low].copy_(flat[start:stop])
    return output


def allgather_blocks(group: SharedMemoryGroup, block: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every local rank's contiguous 1-D CPU ``block`` (``counts[r]`` elements on rank r), concatenated in rank
    order, on every rank."""
    if len(counts) != group.local_size or block.numel() != counts[group.local_rank]:
        raise ValueError(f"a block of {block.numel()} elements is not rank {group.local_rank}'s of {counts}")
    me = group.local_rank
    bounds = block_bounds(counts)
    output = torch.empty(bounds[-1][1], dtype=block.dtype)
    output[bounds[me][0] : bounds[me][1]].copy_(block)
    step = group.chunk_elements(block.dtype)
    for offset in range(0, max(counts, default=0), step):
        slots = group.next_slots(block.dtype)
        own = max(0, min(step, counts[me] - offset))
        slots[me][:own].copy_(block[offset : offset + own])
        group.barrier()
        for rank, (start, _) in enumerate(bounds):
            count = max(0, min(step, counts[rank] - offset))
            if rank != me and count:
                output[start + offset : start + offset + count].copy_(slots[rank][:count])
    return output
