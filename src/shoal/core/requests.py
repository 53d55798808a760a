"""One request builder for every op, shared by the front ends.

A front end converts its tensors to the engine's buffers (torch tensors: ``shoal.torch`` passes its own, ``shoal.tensorflow``
crosses through DLPack), then calls ``submit``: it names the request (``<op>.noname.<n>`` when unnamed), checks
what this rank alone can check (Horovod's argument rules, from ``shoal.core.rules``), builds each ``Request`` and
queues them as one handle. The engine checks dtypes and devices on the same thread (``check_request``), so nothing
bad is ever queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.core import session
from shoal.core.process_sets import ProcessSet, global_process_set, set_id_of
from shoal.core.rules import ReduceSpec, check_alltoall_splits, check_root_rank
from shoal.engine.request import Kind, Request, RequestMeta
from shoal.engine.validation import check_request


def auto_name(kind: Kind, name: str | None, process_set: ProcessSet = global_process_set) -> str:
    """``name``, or the next ``<op>.noname.<n>``, counted per process set so that ranks outside a set stay in step.

    The counters belong to the session: every ``init()`` (an elastic re-form included) starts them from zero.
    """
    if name is not None:
        return name
    set_id = set_id_of(process_set)
    suffix = f".set{set_id}" if set_id else ""
    return f"{kind.value}.noname{suffix}.{session.session().next_number(kind.value, set_id)}"


@dataclass(frozen=True)
class Call:
    """What one call asks of every tensor it submits (the fields a kind does not use stay at their defaults)."""

    kind: Kind
    process_set: ProcessSet = global_process_set
    spec: ReduceSpec | None = None
    """allreduce and reducescatter: the op and its factors."""
    root_rank: int | None = None
    """broadcast: the global rank whose tensor every rank receives."""
    splits: tuple[int, ...] | None = None
    """alltoall: the rows this rank sends to each member (None: an even split)."""
    in_place: bool = False
    """allreduce and broadcast: write the result into the input."""


def _check_writable(tensor: torch.Tensor, kind: Kind) -> None:
    """An in-place result must be writable element by element: an expanded tensor shares memory between elements."""
    if tensor.is_contiguous():  # the common case, and cheap: a contiguous tensor has no stride 0 along a dimension > 1
        return
    if any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape, strict=True)):
        raise ValueError(
            f"{kind.value}: the in-place form cannot write into a tensor whose elements share memory (an expand()ed "
            "view); use the out-of-place form or pass tensor.clone()"
        )


def _check_call(call: Call, shape: Sequence[int | None] | None, splits_known: bool = True) -> None:
    """Horovod's argument rules that this rank can check alone, before anything is queued: the root rank, and what
    the shape shows (a scalar, an alltoall's rows against its splits). ``shape``: None, or None dimensions, where a
    graph does not know them yet; ``splits_known``: False for an alltoall whose splits only its run will show."""
    if call.kind == Kind.BROADCAST:
        check_root_rank(call.root_rank, session.session().engine.size)
    if shape is not None and call.kind in (Kind.ALLTOALL, Kind.REDUCESCATTER) and len(shape) == 0:
        raise ValueError(f"{call.kind.value} needs a tensor with at least one dimension")
    if call.kind == Kind.ALLTOALL and splits_known and shape and shape[0] is not None:
        check_alltoall_splits(call.splits, shape[0], call.process_set.size())


def _meta(
    call: Call, name: str, dtype: str, shape: tuple[int, ...], device: str = "cpu", shared: tuple[str, int] | None = None
) -> RequestMeta:
    """The metadata of ``call`` on a tensor of ``dtype``, ``shape`` and ``device`` type (``shared``: see
    ``RequestMeta.shared``)."""
    spec = call.spec
    return RequestMeta(
        name=name,
        kind=call.kind,
        process_set=set_id_of(call.process_set),
        dtype=dtype,
        shape=shape,
        device=device,
        op=None if spec is None else int(spec.op),
        prescale=1.0 if spec is None else float(spec.prescale),
        postscale=1.0 if spec is None else float(spec.postscale),
        root=call.root_rank,
        splits=call.splits,
        shared=shared,
    )


def check_where_built(
    call: Call, dtype: str, shape: Sequence[int | None] | None, name: str | None = None, splits_known: bool = True
) -> None:
    """The checks a graph front end makes where its op is built, as Horovod's compiled ops do: the dtype, the reduce
    op and its factors, the root rank, and what the static shape shows (a scalar, an uneven alltoall split). What only
    the values show (splits held in a tensor, a dimension known when the graph runs) is checked when it runs.

    Args:
        dtype: the dtype's name (``float32``; TensorFlow and torch name them alike).
        shape: the static shape, None for unknown dimensions, or None when even the rank is unknown.
        name: the op's name, for the messages.
        splits_known: False for an alltoall whose splits only its run will show (``call.splits`` is then None).

    Raises:
        TypeError, ValueError, UnsupportedOperationError: as the same call with a tensor would.
    """
    _check_call(call, shape, splits_known)
    static = tuple(0 if dim is None else dim for dim in shape or ())
    check_request(_meta(call, name or f"{call.kind.value} being built", dtype, static))


_DTYPE_NAMES: dict[torch.dtype, str] = {}
"""``float32`` for ``torch.float32``: the name a request carries, looked up instead of formatted per request."""


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_META_CACHE_ENTRIES = 4096
"""Checked metadata kept per session; past this many, the cache starts afresh (a job naming every call anew)."""


def build_meta(call: Call, tensor: torch.Tensor, name: str, shared: tuple[str, int] | None = None) -> RequestMeta:
    """What every rank must agree on for ``tensor``, after the checks this rank can make alone (``shared``: the
    arena range the tensor is, see ``RequestMeta.shared``)."""
    shape = tuple(tensor.shape)
    _check_call(call, shape)
    # The device type, not its index: with torch.cuda.set_device(hvd.local_rank()) every rank has its own.
    return _meta(call, name, _dtype_name(tensor.dtype), shape, tensor.device.type, shared=shared)


def _meta_key(call: Call, tensor: torch.Tensor, name: str, shared: tuple[str, int] | None) -> tuple[Any, ...]:
    """Everything ``build_meta`` and ``check_request`` read: equal keys give equal, equally valid metadata."""
    set_id = set_id_of(call.process_set)  # raises for a set that is not registered in this session
    shape = tuple(tensor.shape)
    return (name, set_id, call.kind, call.spec, call.root_rank, call.splits, tensor.dtype, shape, tensor.device.type, shared)


def build(call: Call, tensor: torch.Tensor, name: str, shared: tuple[str, int] | None = None) -> Request:
    """One ``Request`` for ``tensor``: the negotiated metadata, a contiguous input and where the result lands.

    The metadata is checked here, Horovod's rules first and then the engine's ``check_request``, so the engine
    need not check it again. A repeating call (the same name, op, process set, dtype, shape and device) reuses the
    metadata made and checked the first time in this session.
    """
    key = _meta_key(call, tensor, name, shared)
    current = session.current_session()
    cache = current.metas if current is not None else {}
    meta = cache.get(key)
    fresh = meta is None
    if meta is None:
        meta = build_meta(call, tensor, name, shared)
    detached = tensor.detach() if tensor.requires_grad else tensor  # no graph to cut: spare the alias
    contiguous = detached.contiguous()
    output: torch.Tensor | None = None
    if call.kind in (Kind.ALLREDUCE, Kind.BROADCAST):
        if call.in_place:
            _check_writable(tensor, call.kind)  # strides are not in the key: checked every time
            output = contiguous
        else:
            output = torch.empty_like(contiguous, memory_format=torch.contiguous_format)
    if fresh:
        check_request(meta)
        if len(cache) >= _META_CACHE_ENTRIES:
            cache.clear()
        cache[key] = meta
    request = Request(meta, contiguous, output, checked=True)
    if output is contiguous and contiguous is not detached:  # in place on a non-contiguous tensor: write it back
        request.user_tensor = tensor
    return request


def first(results: list[Any]) -> Any:
    """A one-tensor handle's result."""
    return results[0]


def as_list(results: list[Any]) -> list[Any]:
    """A grouped handle's results, in order."""
    return list(results)


def submit(
    call: Call,
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    grouped: bool = False,
    names: Sequence[str] | None = None,
    shared: Sequence[tuple[str, int] | None] | None = None,
    blocking: bool = False,
) -> int:
    """Queue ``tensors`` as one handle and return it; ``synchronize`` gives the one result, or the list (grouped).

    Args:
        call: what to do with each tensor.
        tensors: the engine's buffers (exactly one unless ``grouped``).
        name: the request's name, or for a group the base of ``<name>.<i>``; None: an automatic name.
        grouped: several tensors as one handle (fused together where they fit).
        names: each tensor's own name instead (the optimizer names gradients after their parameters).
        shared: per tensor, the arena range it is (``RequestMeta.shared``), or None.
        blocking: the caller synchronizes at once (``session.submit``).
    """
    if names is None:
        base = auto_name(call.kind, name, call.process_set)
        names = [f"{base}.{i}" for i in range(len(tensors))] if grouped else [base]
    ranges = [None] * len(tensors) if shared is None else shared
    requests = [build(call, tensor, n, r) for tensor, n, r in zip(tensors, names, ranges, strict=True)]
    return session.submit(requests, as_list if grouped else first, blocking)


def run(call: Call, tensors: Sequence[torch.Tensor], name: str | None = None, grouped: bool = False) -> Any:
    """``submit`` and wait: the one result, or the list for a group (what every blocking form of an op is)."""
    return session.synchronize(submit(call, tensors, name, grouped=grouped, blocking=True))


def submit_control(kind: Kind, process_set: ProcessSet = global_process_set) -> int:
    """Queue a request that carries no tensor (barrier, join)."""
    if kind == Kind.JOIN:
        meta = RequestMeta(name="shoal.join", kind=Kind.JOIN, process_set=0)
    else:
        meta = RequestMeta(name=auto_name(kind, None, process_set), kind=kind, process_set=set_id_of(process_set))
    return session.submit([Request(meta, None, None)], first)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the process set reaches the barrier."""
    session.synchronize(submit_control(Kind.BARRIER, process_set))


def join(device: int = -1) -> int:
    """Declare that this rank has no more work; returns the last rank to join once every rank has.

    Until then this rank stands in for every collective the others run, contributing zeros (an empty slice to
    allgather), so ranks with more batches never hang waiting for it. ``device`` is accepted for Horovod
    compatibility.
    """
    return session.synchronize(submit_control(Kind.JOIN))
