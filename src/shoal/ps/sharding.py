"""Split parameters over parameter servers so that every server holds the same number of bytes.

Poseidon's servers each see ``P·bytes/S`` only if the bytes are balanced, and one huge fully-connected layer on a
single server would make that server the bottleneck. So the parameters are laid end to end, in an order every
party agrees on, and the line is cut into S equal runs of bytes: server s owns the bytes in
``[s·total/S, (s+1)·total/S)``. A tensor that crosses a cut is split there into contiguous flat pieces. Loads then
differ by at most one element, a tensor of k fair shares spans about k servers, and at most S-1 tensors are cut,
which keeps the message count low (greedy largest-first placement of whole tensors leaves up to a whole tensor of
imbalance, and splitting everything finely multiplies messages).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """A contiguous flat range of one parameter, owned by one server."""

    index: int
    """Position in the plan; the same on every party, used as the piece's id on the wire."""
    param: int
    """Index of the parameter (in the order the plan was built from)."""
    start: int
    """First element of the range in the parameter's flattened view."""
    numel: int
    """Number of elements."""
    itemsize: int
    """Bytes per element."""
    server: int
    """The server (0..S-1) that owns the range."""

    @property
    def nbytes(self) -> int:
        """The piece's size in bytes."""
        return self.numel * self.itemsize


def build_shard_plan(sizes: list[tuple[int, int]], servers: int) -> list[Piece]:
    """Cut the parameters, laid end to end, into ``servers`` equal runs of bytes.

    Args:
        sizes: (numel, itemsize) of every parameter, in a fixed order every party agrees on.
        servers: S, the number of servers.

    Returns:
        The pieces, ordered by parameter and then by offset (empty parameters have none).
    """
    if servers < 1:
        raise ValueError(f"need at least one server, got {servers}")
    total = sum(numel * itemsize for numel, itemsize in sizes)
    pieces: list[Piece] = []
    offset = 0  # bytes laid down before the current element
    for param, (numel, itemsize) in enumerate(sizes):
        element = 0
        while element < numel:
            position = offset + element * itemsize
            server = min(position * servers // total, servers - 1)
            end = -(-(server + 1) * total // servers)  # this server's run ends here (ceiling)
            count = numel - element if server == servers - 1 else min(numel - element, -(-(end - position) // itemsize))
            pieces.append(Piece(len(pieces), param, element, count, itemsize, server))
            element += count
        offset += numel * itemsize
    return pieces


def server_loads(pieces: list[Piece], servers: int) -> list[int]:
    """Bytes held by each server."""
    loads = [0] * servers
    for piece in pieces:
        loads[piece.server] += piece.nbytes
    return loads
