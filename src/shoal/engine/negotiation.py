"""Negotiation: decide, identically on every rank, which requests are ready everywhere and whether they agree.

Every rank sees the same gathered request lists, so each runs the coordinator's logic on the same data and
reaches the same responses in the same order: a coordinator plus broadcast, in one collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from shoal.engine.request import Kind, ReduceOp, RequestMeta


@dataclass(frozen=True)
class Response:
    """An agreed decision: run this collective (or report this error) on the ranks of one process set."""

    name: str
    kind: Kind
    process_set: int
    rank_metas: tuple[RequestMeta | None, ...]
    """Each global rank's request; None for ranks outside the set and ranks that joined."""
    error: str | None = None
    last_joined: int | None = None
    """For a join response: the last rank to join."""

    @cached_property
    def meta(self) -> RequestMeta:
        """The agreed request (the first submitter's; for a valid response all agree on what matters). Found once:
        a cycle reads it several times per response, and a cached response lives for many cycles."""
        return next(m for m in self.rank_metas if m is not None)


def _describe(values: dict[int, object]) -> str:
    return ", ".join(f"rank {rank}: {value}" for rank, value in sorted(values.items()))


def _op_name(op: int | None) -> str:
    return "none" if op is None else ReduceOp(op).name


def find_mismatch(metas: dict[int, RequestMeta], set_size: int) -> str | None:
    """The first disagreement between ranks' requests for one tensor, described for the user, or None."""
    first = next(iter(metas.values()))
    name = first.name

    def differs(label: str, key: object) -> str | None:
        values = {rank: key(meta) for rank, meta in metas.items()}  # type: ignore[operator]
        if len(set(values.values())) > 1:
            return f"Mismatched {label} for tensor '{name}': {_describe(values)}"
        return None

    checks: list[tuple[str, object]] = [
        ("operations", lambda m: m.kind.value),
        ("data types", lambda m: m.dtype),
        ("devices", lambda m: m.device),
    ]
    if first.kind in (Kind.ALLREDUCE, Kind.BROADCAST, Kind.REDUCESCATTER):
        checks.append(("shapes", lambda m: m.shape))
    if first.kind in (Kind.ALLGATHER, Kind.ALLTOALL):
        checks.append(("ranks (number of dimensions)", lambda m: len(m.shape)))
        checks.append(("shapes beyond the first dimension", lambda m: m.shape[1:]))
    if first.kind in (Kind.ALLREDUCE, Kind.REDUCESCATTER):
        checks.append(("reduce ops", lambda m: _op_name(m.op)))
        checks.append(("prescale factors", lambda m: m.prescale))
        checks.append(("postscale factors", lambda m: m.postscale))
    if first.kind == Kind.BROADCAST:
        checks.append(("root ranks", lambda m: m.root))
    if first.kind == Kind.ADD_PROCESS_SET:
        checks.append(("process set ranks", lambda m: m.payload))
    for label, key in checks:
        message = differs(label, key)
        if message is not None:
            return message
    if first.kind == Kind.ALLTOALL:
        for rank, meta in metas.items():
            if meta.splits is not None and len(meta.splits) != set_size:
                return f"alltoall '{name}': rank {rank} gave {len(meta.splits)} splits for a set of {set_size} ranks"
    return None


@dataclass
class MessageTable:
    """Requests seen so far that are not yet ready on every rank, and the ranks that have joined."""

    world_size: int
    entries: dict[tuple[int, str], dict[int, RequestMeta]] = field(default_factory=dict)
    joined: list[int] = field(default_factory=list)
    """Ranks that called join(), in the order their joins were seen."""

    def ingest(self, gathered: Sequence[Sequence[RequestMeta]]) -> list[tuple[int, str]]:
        """Add every rank's new requests; returns the (set, name) keys seen for the first time this cycle."""
        fresh = []
        for rank, metas in enumerate(gathered):
            for meta in metas:
                if meta.kind == Kind.JOIN:
                    if rank not in self.joined:
                        self.joined.append(rank)
                    continue
                key = (meta.process_set, meta.name)
                entry = self.entries.setdefault(key, {})
                if not entry:
                    fresh.append(key)
                entry[rank] = meta
        return fresh

    def pending_ranks(self, key: tuple[int, str]) -> list[int]:
        """Ranks that have submitted the request ``key``."""
        return sorted(self.entries.get(key, {}))

    def take_ready(self, members_of: dict[int, tuple[int, ...]]) -> list[Response]:
        """Remove and return the responses for requests now submitted by every member (or joined).

        Args:
            members_of: the global ranks of every process set, by set id.
        """
        responses = []
        for key in list(self.entries):
            process_set, name = key
            metas = self.entries[key]
            members = members_of.get(process_set)
            if members is None:
                del self.entries[key]
                only = next(iter(metas.values()))
                responses.append(self._error(only, metas, f"process set {process_set} does not exist (tensor '{name}')"))
                continue
            outsiders = [rank for rank in metas if rank not in members]
            if outsiders:
                del self.entries[key]
                message = f"ranks {outsiders} are not in process set {process_set} but submitted tensor '{name}'"
                responses.append(self._error(next(iter(metas.values())), metas, message))
                continue
            if not all(rank in metas or rank in self.joined for rank in members):
                continue
            del self.entries[key]
            first = next(iter(metas.values()))
            error = find_mismatch(metas, len(members))
            if error is None and first.kind == Kind.BROADCAST and first.root not in metas:
                error = f"broadcast '{name}': root rank {first.root} has joined or is not in process set {process_set}"
            rank_metas = tuple(metas.get(rank) for rank in range(self.world_size))
            responses.append(Response(name, first.kind, process_set, rank_metas, error=error))
        if len(self.joined) == self.world_size:
            responses.append(Response("shoal.join", Kind.JOIN, 0, (None,) * self.world_size, last_joined=self.joined[-1]))
            self.joined = []
        return responses

    def _error(self, meta: RequestMeta, metas: dict[int, RequestMeta], message: str) -> Response:
        rank_metas = tuple(metas.get(rank) for rank in range(self.world_size))
        return Response(meta.name, meta.kind, meta.process_set, rank_metas, error=message)
