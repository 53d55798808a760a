"""Process sets: collectives over a subset of ranks, as in ``horovod.torch``."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.core import session as handles
from shoal.engine.request import Kind, Request, RequestMeta
from shoal.runtime import context


class ProcessSet:
    """A subset of ranks. Register it on every rank with ``add_process_set`` before using it."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks: list[int] | None = sorted(set(ranks)) if ranks is not None else None
        if ranks is not None and len(self.ranks or []) != len(ranks):
            raise ValueError(f"process set ranks must be unique, got {list(ranks)}")
        self.process_set_id: int | None = None
        self._session_id: int | None = None
        """The session (init) this set was registered in; its id means nothing in any other."""

    def _members(self) -> list[int]:
        if self.ranks is None:
            return list(range(context.current().topology.size))
        return self.ranks

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self._members())

    def rank(self) -> int:
        """This process's rank within the set; raises ValueError when it is not a member."""
        me = context.current().topology.rank
        if me not in self._members():
            raise ValueError(f"rank {me} is not in process set {self.ranks}")
        return self._members().index(me)

    def included(self) -> bool:
        """True when this process belongs to the set."""
        return context.current().topology.rank in self._members()

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
global_process_set.process_set_id = 0


def set_id_of(process_set: ProcessSet) -> int:
    """The registered id of a process set in the current session.

    Raises:
        ValueError: the set was never added, was removed, or was added before the last ``init()`` (after a
            re-init, including an elastic re-form, ids are handed out afresh and an old set's id could name
            another set).
    """
    if process_set is global_process_set:
        return 0
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered; call add_process_set() on every rank first")
    if process_set._session_id != handles.session().id:
        raise ValueError(
            f"{process_set!r} was registered before the last shutdown()/init() (or elastic reset); process sets do "
            "not survive a re-init: call add_process_set() again on every rank"
        )
    return process_set.process_set_id


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set. Every rank (members or not) must call this, in the same order."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    size = context.current().topology.size
    if process_set.ranks is None or not process_set.ranks:
        raise ValueError("add_process_set needs a non-empty list of ranks (the global set always exists)")
    bad = [r for r in process_set.ranks if not 0 <= r < size]
    if bad:
        raise ValueError(f"process set ranks {bad} are outside the world of size {size}")
    current = handles.session()
    if process_set.process_set_id is not None and process_set._session_id == current.id:
        raise ValueError(f"{process_set!r} is already registered")
    meta = RequestMeta(
        name=f"shoal.add_process_set.{current.next_number('add_process_set', 0)}",
        kind=Kind.ADD_PROCESS_SET,
        process_set=0,
        payload=tuple(process_set.ranks),
    )
    process_set.process_set_id = handles.synchronize(handles.submit([Request(meta, None, None)], lambda r: r[0]))
    process_set._session_id = current.id
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (all must call this); returns True if it was registered."""
    if process_set.process_set_id in (None, 0):
        return False
    set_id = set_id_of(process_set)
    meta = RequestMeta(
        name=f"shoal.remove_process_set.{handles.session().next_number('remove_process_set', 0)}",
        kind=Kind.REMOVE_PROCESS_SET,
        process_set=0,
        payload=(set_id,),
    )
    removed = bool(handles.synchronize(handles.submit([Request(meta, None, None)], lambda r: r[0])))
    process_set.process_set_id = None
    return removed
