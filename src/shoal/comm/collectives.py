"""The collectives the engine issues, over torch.distributed groups (gloo for CPU tensors, NCCL for CUDA)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from shoal.comm.reductions import REDUCE_INTO

Group = Any
"""A torch.distributed process group, or None for the default (world) group."""

_SUM, _MIN, _MAX, _PRODUCT = dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT
_REDUCE_OPS = {"sum": _SUM, "min": _MIN, "max": _MAX, "product": _PRODUCT}


def allreduce_(tensor: torch.Tensor, reduction: str, group: Group) -> None:
    """Reduce ``tensor`` in place across the group; ``reduction`` is sum, min, max or product."""
    dist.all_reduce(tensor, op=_REDUCE_OPS[reduction], group=group)


def bitwise_and_(words: torch.Tensor, group: Group) -> None:
    """AND an int64 bit vector across the group, in place: the negotiation cycle's one collective."""
    dist.all_reduce(words, op=dist.ReduceOp.BAND, group=group)


def broadcast_(tensor: torch.Tensor, root: int, group: Group) -> None:
    """Broadcast ``tensor`` from global rank ``root`` to the group, in place."""
    dist.broadcast(tensor, src=root, group=group)


def allgather_equal(tensor: torch.Tensor, group_size: int, group: Group) -> list[torch.Tensor]:
    """Gather equally shaped tensors from every group member, in group-rank order."""
    chunks = [torch.empty_like(tensor) for _ in range(group_size)]
    dist.all_gather(chunks, tensor, group=group)
    return chunks


def alltoall(
    output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Group
) -> None:
    """Send ``input_splits[i]`` rows of ``tensor`` to member i; receive ``output_splits[i]`` rows from it."""
    dist.all_to_all_single(output, tensor, output_splits, input_splits, group=group)


def ring_reduce_scatter(
    tensor: torch.Tensor, counts: list[int], reduction: str, members: list[int], group: Group
) -> torch.Tensor:
    """This member's block of the 1-D ``tensor`` (the same size on every member) reduced across the group, by a ring.

    Member i's block is ``counts[i]`` elements after the blocks before it (``members``: the group's global ranks, in
    order). In N-1 steps each member sends one partly reduced block to the next member and receives one from the
    previous, so it sends (N-1)/N of the tensor's bytes, where an allreduce sends about twice that. gloo's own
    reduce_scatter runs an allreduce per member (pytorch/pytorch#149869), so it is not used.
    """
    size = len(members)
    me = members.index(dist.get_rank())
    starts = [sum(counts[:i]) for i in range(size)]

    def block(index: int) -> torch.Tensor:
        return tensor[starts[index] : starts[index] + counts[index]]

    reduce_into = REDUCE_INTO[reduction]
    partial = block((me - 1) % size).clone()
    for step in range(1, size):
        index = (me - step - 1) % size  # the block arriving now, partly reduced by the members before this one
        incoming = torch.empty(counts[index], dtype=tensor.dtype, device=tensor.device)
        ops = []
        if partial.numel():  # every member knows every block's size: an empty block is neither sent nor awaited
            ops.append(dist.P2POp(dist.isend, partial, members[(me + 1) % size], group))
        if incoming.numel():
            ops.append(dist.P2POp(dist.irecv, incoming, members[(me - 1) % size], group))
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
        partial = reduce_into(incoming, block(index))
    return partial


def barrier(group: Group) -> None:
    """Wait until every member of the group arrives."""
    dist.barrier(group=group)


def allgather_bytes(data: bytes, group_size: int, group: Group) -> list[bytes]:
    """Gather a byte string from every group member, in group-rank order (lengths first, then padded data).

    The engine negotiates with this and its own JSON format: unlike ``all_gather_object`` nothing is unpickled.
    """
    lengths = allgather_equal(torch.tensor([len(data)], dtype=torch.int64), group_size, group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    chunks = allgather_equal(padded, group_size, group)
    return [chunk[: int(n.item())].numpy().tobytes() for chunk, n in zip(chunks, lengths, strict=True)]


def new_group(ranks: list[int], timeout_s: float | None = None, connect_timeout_s: float | None = None) -> Group:
    """Create a process group of ``ranks``; every world rank must call this in the same order.

    Args:
        ranks: the global ranks of the group.
        timeout_s: how long any collective on the group may block before it fails; None takes torch's default.
        connect_timeout_s: how long creating the group may wait for a member's connection, when shorter than
            ``timeout_s`` (``connect_timeout``).
    """
    bound = connect_timeout(timeout_s, connect_timeout_s)
    if bound is None:
        return dist.new_group(ranks=ranks, timeout=timedelta(seconds=timeout_s) if timeout_s is not None else None)
    group = dist.new_group(ranks=ranks, timeout=timedelta(seconds=bound))
    if dist.get_rank() in ranks and timeout_s is not None:  # (a bound implies a timeout_s)
        lift_timeout(group, timeout_s)
    return group


def connect_timeout(timeout_s: float | None, connect_timeout_s: float | None) -> float | None:
    """The timeout to create a group with so that its connections are waited for at most ``connect_timeout_s``
    (torch's gloo waits for a peer's connection as long as for a collective, and a peer that dies after publishing
    its address never connects); None where the group's own ``timeout_s`` already bounds it, or where this torch
    cannot lengthen a group's timeout afterwards (``lift_timeout``)."""
    if connect_timeout_s is None or timeout_s is None or connect_timeout_s >= timeout_s:
        return None
    return connect_timeout_s if hasattr(distributed_c10d, "_set_pg_timeout") else None


def lift_timeout(group: Group | None, timeout_s: float) -> None:
    """Give ``group`` (None: the default group), created with a connection bound, its timeout for collectives."""
    distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)


def destroy_group(group: Group) -> None:
    """Release a process group created by ``new_group``."""
    dist.destroy_process_group(group)
