"""Run agreed responses: copy into fusion buffers, issue the collective through ``shoal.comm``, copy out."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shoal.comm import collectives
from shoal.comm.hierarchical import HierarchicalAllreduce
from shoal.comm.shared_arena import SharedArena
from shoal.engine import adasum
from shoal.engine.fusion import FusedBatch
from shoal.engine.negotiation import Response
from shoal.engine.request import DATA_KINDS, Kind, ReduceOp, Request, RequestMeta
from shoal.engine.stall import CollectiveWatch
from shoal.engine.timeline import Timeline
from shoal.engine.validation import REDUCING_DTYPES
from shoal.exceptions import CollectiveMismatchError, HorovodInternalError
from shoal.log import get_logger

# gloo has no int16 kernels; such tensors travel as int32 (exact, and wraps the same way once cast back).
_WIRE_DTYPES = {torch.int16: torch.int32}
_REDUCTIONS = {ReduceOp.Average: "sum", ReduceOp.Sum: "sum", ReduceOp.Min: "min", ReduceOp.Max: "max"}
_REDUCTIONS[ReduceOp.Product] = "product"


_WIRED_KINDS = frozenset(kind.value for kind in (*DATA_KINDS, Kind.BARRIER, Kind.ADD_PROCESS_SET))


class TransportError(RuntimeError):
    """A collective on the wire failed (a peer died, a timeout): the engine cannot go on."""


@dataclass
class ProcessSetState:
    """A registered process set: its global ranks (ascending) and its torch.distributed group."""

    members: tuple[int, ...]
    group: Any


@dataclass
class RoundPlan:
    """An armed one-round set's buffers (``Executor.plan_round``), made once and reused every round it is sent."""

    responses: list[Response]
    keys: list[tuple[int, str]]
    """(process set, name) of each response, in order."""
    cache_ids: list[int]
    buffer: torch.Tensor
    """Every part's data, then one count per part and the quiet count: what the round's one allreduce sends."""
    data: torch.Tensor
    """The parts' data, without the counts."""
    parts: list[torch.Tensor]
    """Each response's flat range of the buffer."""
    control: Any
    """The counts, as a numpy view of the buffer (read and written without a torch call per value)."""
    sizes: list[int]
    """Each response's elements."""
    prescale: float
    postscale: float
    """The factor applied to a delivered part (Average's division by the members included)."""
    state: ProcessSetState


_BIT_TWINS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""A signed integer of each width: the bits of any fixed-width dtype travel as it, unchanged."""


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a dtype the transport moves: itself for a reducing dtype, else its bits as a signed integer of
    the same width (the same memory; ``.view(dtype)`` turns the result back, bit for bit)."""
    if str(tensor.dtype).removeprefix("torch.") in REDUCING_DTYPES:
        return tensor
    return tensor.view(_BIT_TWINS[tensor.element_size()])


def _dtype(meta: RequestMeta) -> torch.dtype:
    return getattr(torch, meta.dtype)


def _scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiply in place; integer tensors are scaled in float64 and truncated, as Horovod does."""
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_((tensor.double() * factor).to(tensor.dtype))


def _postscale_(tensor: torch.Tensor, op: ReduceOp, postscale: float, members: int) -> None:
    """Scale a reduced buffer as Horovod does: Average is a sum scaled by ``postscale / members`` in one step, so an
    integer average truncates toward zero once (-3 over 2 ranks gives -1)."""
    _scale_(tensor, _postscale_factor(op, postscale, members))


def _postscale_factor(op: ReduceOp, postscale: float, members: int) -> float:
    return postscale / members if op == ReduceOp.Average else postscale


def _scale_into(source: torch.Tensor, factor: float, out: torch.Tensor) -> None:
    """``out = source * factor``, exactly as ``_scale_`` then a copy would give (one pass for floating point)."""
    if factor == 1.0:
        out.copy_(source)
    elif source.is_floating_point() or source.is_complex():
        torch.mul(source, factor, out=out)
    else:
        _scale_(source, factor)
        out.copy_(source)


def _postscaler(op: ReduceOp, postscale: float, members: int) -> Callable[[torch.Tensor], None] | None:
    """``_postscale_`` as a step on part of a reduced buffer (None when it changes nothing)."""
    factor = _postscale_factor(op, postscale, members)
    return None if factor == 1.0 else lambda part: _scale_(part, factor)


def _real_view(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as pairs of reals (same memory); sums and averages are then computed part by part."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def split_rows(rows: int, parts: int) -> list[int]:
    """Rows per part when ``rows`` are split as evenly as possible, the first parts taking the remainder."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class Executor:
    """Executes batches of responses on this rank."""

    def __init__(
        self,
        rank: int,
        process_sets: dict[int, ProcessSetState],
        timeline: Callable[[], Timeline | None],
        hierarchical: HierarchicalAllreduce | None,
        watch: CollectiveWatch,
        group_timeout_s: float | None = None,
    ) -> None:
        self.rank = rank
        self.hierarchical = hierarchical
        self._watch = watch
        self._group_timeout_s = group_timeout_s
        self._reached_wire = False
        self.use_hierarchical = True
        """Autotune may turn the shared-memory path off (and on) for data, on every rank in the same cycle."""
        self.process_sets = process_sets
        self._timeline = timeline
        self.next_process_set_id = 1
        self.collective_calls = 0
        self.joined: frozenset[int] = frozenset()
        """The ranks that have joined (they stand in for collectives with zeros), as every rank knows them."""
        self.arenas: dict[str, SharedArena] = {}
        """This rank's registered shared-memory arenas by key (``RequestMeta.shared``), mapped with the host's peers'."""
        self._round_us = (0.0, 0.0, "")
        """The last one-round cycle on the timeline's clock: (wire start, wire end, its phase name)."""
        self.executions: dict[tuple[int, str], tuple[float, int, int]] = {}
        """Per data request, its last execution: (its share by size of its batch's seconds, its elements, the
        batch's elements). The planner compares these with its predictions. Written by the engine thread only; a
        reader sees a whole tuple, new or old."""

    def _begin(self, responses: list[Response], phase: str) -> None:
        timeline = self._timeline()
        if timeline is not None:
            for response in responses:
                timeline.begin(response.name, phase)

    def _end(self, responses: list[Response], phase: str) -> None:
        timeline = self._timeline()
        if timeline is not None:
            for response in responses:
                timeline.end(response.name, phase)

    @contextlib.contextmanager
    def _wire(self, what: str) -> Iterator[None]:
        """Around every call that talks to peers: watched while it blocks, and any failure is a TransportError."""
        self._reached_wire = True
        try:
            with self._watch.watching(what):
                yield
        except TransportError:
            raise
        except Exception as error:
            raise TransportError(f"{what} failed: {error}") from error

    def run(self, batch: FusedBatch, local: dict[tuple[int, str], Request]) -> None:
        """Execute one batch; completes (or fails) this rank's requests in it.

        A failure after the wire (scaling, copying results out) fails this batch's requests alone, with an error
        naming them; the engine goes on. A failure on the wire raises ``TransportError``: the peers' state is
        unknown then, and the engine must stop. So does a failure before the wire (say, no memory for the fusion
        buffer): the peers are already inside that collective, and this rank skipping it would pair its next
        collective with theirs. Deterministic errors never get that far: requests are validated at submission.
        """
        requests = [local.pop((r.process_set, r.name), None) for r in batch.responses]
        self._reached_wire = False
        try:
            self._run(batch, requests)
        except TransportError:
            raise
        except Exception as error:
            names = ", ".join(f"'{r.name}'" for r in batch.responses)
            kind = batch.responses[0].kind.value
            if not self._reached_wire and batch.responses[0].error is None and kind in _WIRED_KINDS:
                raise TransportError(
                    f"{kind} of {names} failed on rank {self.rank} before reaching its peers: {error}"
                ) from error
            message = f"Shoal could not complete {kind} of {names} on rank {self.rank}: {error}"
            get_logger().error("%s", message)
            for request in requests:
                if request is not None and not request.done.is_set():
                    request.fail(RuntimeError(message))

    def _run(self, batch: FusedBatch, requests: list[Request | None]) -> None:
        first = batch.responses[0]
        if first.error is not None:
            for request in requests:
                if request is not None:
                    request.fail(CollectiveMismatchError(first.error))
            return
        if first.kind == Kind.JOIN:
            for request in requests:
                if request is not None:
                    request.complete(first.last_joined)
            return
        if first.kind in (Kind.ADD_PROCESS_SET, Kind.REMOVE_PROCESS_SET):
            self._manage_process_set(first, requests[0])
            return
        state = self.process_sets[first.process_set]
        if self.rank not in state.members:
            return
        phase = f"{first.kind.value.upper()}"
        self.collective_calls += 1
        self._begin(batch.responses, phase)
        started = time.perf_counter()
        try:
            if first.kind == Kind.ALLREDUCE:
                self._allreduce(batch.responses, requests, state)
            elif first.kind == Kind.ALLGATHER:
                self._allgather(first, requests[0], state)
            elif first.kind == Kind.BROADCAST:
                self._broadcast(first, requests[0], state)
            elif first.kind == Kind.ALLTOALL:
                self._alltoall(first, requests[0], state)
            elif first.kind == Kind.REDUCESCATTER:
                self._reducescatter(first, requests[0], state)
            elif first.kind == Kind.BARRIER:
                with self._wire(f"barrier '{first.name}'"):
                    collectives.barrier(state.group)
                if requests[0] is not None:
                    requests[0].complete(None)
        finally:
            self._end(batch.responses, phase)
        self._record_seconds(batch.responses, time.perf_counter() - started)

    def _record_seconds(self, responses: list[Response], seconds: float, sizes: list[int] | None = None) -> None:
        """Each response's share by size of a batch's ``seconds`` (``sizes``: their elements, when already known)."""
        if sizes is None:
            sizes = [math.prod(r.meta.shape) for r in responses]
        total = sum(sizes)
        for response, size in zip(responses, sizes, strict=True):
            share = size / total if total else 1 / len(responses)
            self.executions[(response.process_set, response.name)] = (seconds * share, size, total)

    def _input(self, response: Response, request: Request | None, rows: int | None = None) -> torch.Tensor:
        """This rank's input for a response, or zeros when it joined and submitted nothing."""
        if request is not None and request.tensor is not None:
            return request.tensor
        meta = response.meta
        shape = (rows, *meta.shape[1:]) if rows is not None else meta.shape
        # Requests name the device type only; "cuda" is this rank's current device, as each rank has its own.
        return torch.zeros(shape, dtype=_dtype(meta), device=meta.device)

    def _allreduce(self, responses: list[Response], requests: list[Request | None], state: ProcessSetState) -> None:
        meta = responses[0].meta
        dtype = _dtype(meta)
        wire = _WIRE_DTYPES.get(dtype, dtype)
        arena = self._arena_of(responses, requests, state)
        if arena is not None:
            self._allreduce_in_arena(responses[0], requests[0], state, arena)
            return
        inputs = [self._input(r, q) for r, q in zip(responses, requests, strict=True)]
        single_in_place = (
            len(responses) == 1 and requests[0] is not None and requests[0].output is requests[0].tensor and wire == dtype
        )
        self._begin(responses, "MEMCPY_IN_FUSION_BUFFER")
        if single_in_place:
            buffer = inputs[0].view(-1)
        else:
            flat = [tensor.reshape(-1) for tensor in inputs]
            if wire == dtype:
                buffer = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
            else:
                buffer = torch.cat([piece.to(wire) for piece in flat])
        _scale_(buffer, meta.prescale)
        self._end(responses, "MEMCPY_IN_FUSION_BUFFER")
        assert meta.op is not None  # allreduce and reducescatter requests always carry their op
        op = ReduceOp(meta.op)
        if op == ReduceOp.Adasum:
            self._begin(responses, "ADASUM_ALLREDUCE")
            self._adasum_(buffer, [tensor.numel() for tensor in inputs], state, responses[0].name)
            self._end(responses, "ADASUM_ALLREDUCE")
            _postscale_(buffer, op, meta.postscale, len(state.members))
            scaled = True
        else:
            phase = self._reduce_phase(buffer, responses[0].process_set)
            self._begin(responses, phase)
            members = len(state.members)
            scaled = self._reduce_(
                buffer,
                _REDUCTIONS[op],
                responses[0].process_set,
                state,
                responses[0].name,
                _postscaler(op, meta.postscale, members),
            )
            self._end(responses, phase)
        self._begin(responses, "MEMCPY_OUT_FUSION_BUFFER")
        if not scaled:
            _postscale_(buffer, op, meta.postscale, len(state.members))
        if not single_in_place:
            pieces = buffer.split([tensor.numel() for tensor in inputs])
            kept = [
                (q.output.view(-1), p) for q, p in zip(requests, pieces, strict=True) if q is not None and q.output is not None
            ]
            if kept:
                # One multi-tensor copy instead of a Python-level copy per tensor (a cast only off the wire dtype).
                sources = [piece for _, piece in kept] if wire == dtype else [piece.to(out.dtype) for out, piece in kept]
                torch._foreach_copy_([out for out, _ in kept], sources)
        for request in requests:
            if request is not None:
                request.complete(request.output)
        self._end(responses, "MEMCPY_OUT_FUSION_BUFFER")

    def _arena_of(
        self, responses: list[Response], requests: list[Request | None], state: ProcessSetState
    ) -> SharedArena | None:
        """The arena to reduce in place, when every member's request is the same range of a registered arena and the
        shared-memory path is on; else None (the ordinary path, which is right for any tensor).

        Every rank decides from the agreed response and settings alone, so all take the same path.
        """
        meta = responses[0].meta
        if len(responses) != 1 or meta.shared is None or meta.prescale != 1.0 or meta.op == ReduceOp.Adasum:
            return None
        rank_metas = [responses[0].rank_metas[member] for member in state.members]
        if self.joined.intersection(state.members) or any(m is None or m.shared != meta.shared for m in rank_metas):
            return None  # a rank that joined (a cached response lists it still), or one whose gradient is elsewhere
        request = requests[0]
        if request is None or request.tensor is None or not self._uses_shared_memory(request.tensor, meta.process_set):
            return None
        arena = self.arenas.get(meta.shared[0])
        if arena is None:
            raise HorovodInternalError(f"allreduce '{meta.name}' names shared arena {meta.shared[0]!r}, not registered here")
        return arena

    def _allreduce_in_arena(
        self, response: Response, request: Request | None, state: ProcessSetState, arena: SharedArena
    ) -> None:
        """Reduce a range of every local rank's arena in place: no fusion buffer, no copy in or out."""
        meta = response.meta
        assert request is not None and request.tensor is not None and meta.shared is not None
        offset = meta.shared[1]
        tensor = request.tensor
        if tensor.data_ptr() != arena.own().data_ptr() + offset:
            raise HorovodInternalError(f"allreduce '{meta.name}': the tensor is not its arena's range at byte {offset}")
        assert self.hierarchical is not None and meta.op is not None
        phase = self._reduce_phase(tensor, meta.process_set)
        self._begin([response], phase)
        op = ReduceOp(meta.op)
        finish = _postscaler(op, meta.postscale, len(state.members))
        with self._wire(f"allreduce '{meta.name}'"):
            self.hierarchical.allreduce_arena_(arena, offset, tensor.dtype, tensor.numel(), _REDUCTIONS[op], finish)
        self._end([response], phase)
        request.complete(request.output)

    # ----- the one-round cycle (see Engine._speculative_cycle) -----

    def plan_round(self, armed: list[tuple[int, Response]]) -> RoundPlan:
        """The buffers of an armed set, made once and reused every round the set is sent."""
        responses = [response for _, response in armed]
        meta = responses[0].meta
        assert meta.op is not None
        sizes = [math.prod(r.meta.shape) for r in responses]
        total = sum(sizes)
        buffer = torch.empty(total + len(responses) + 1, dtype=_dtype(meta))
        *parts, control = buffer.split([*sizes, len(responses) + 1])
        state = self.process_sets[meta.process_set]
        return RoundPlan(
            responses=responses,
            keys=[(r.process_set, r.name) for r in responses],
            cache_ids=[cache_id for cache_id, _ in armed],
            buffer=buffer,
            data=buffer[:total],
            parts=parts,
            control=control.numpy(),
            sizes=sizes,
            prescale=meta.prescale,
            postscale=_postscale_factor(ReduceOp(meta.op), meta.postscale, len(state.members)),
            state=state,
        )

    def speculate(self, plan: RoundPlan, requests: list[Request | None], control: list[int]) -> list[int]:
        """One SUM allreduce of a planned set's data, zeros where ``requests`` has None, with ``control`` appended,
        in the plan's own buffer (the inputs stay as they are, so a part that not every rank sent is simply dropped).

        Returns the summed control values; the reduced data stays in the plan's buffer for ``deliver``. A failure
        here is on the wire, or before it while the peers are inside the collective: either way the engine must
        stop (``TransportError``).
        """
        first = plan.responses[0]
        try:
            for part, request in zip(plan.parts, requests, strict=True):
                if request is not None and request.tensor is not None:
                    part.copy_(request.tensor.view(-1))
                else:
                    part.zero_()
            plan.control[:] = control
            _scale_(plan.data, plan.prescale)
            self.collective_calls += 1
            timeline = self._timeline()
            started_us = timeline.now_us() if timeline is not None else 0.0
            self._reduce_(plan.buffer, "sum", first.process_set, plan.state, first.name)
            if timeline is not None:
                self._round_us = (started_us, timeline.now_us(), self._reduce_phase(plan.buffer, first.process_set))
        except TransportError:
            raise
        except Exception as error:
            raise TransportError(f"one-round allreduce of '{first.name}' failed on rank {self.rank}: {error}") from error
        return [int(value) for value in plan.control.tolist()]

    def deliver(self, plan: RoundPlan, requests: list[Request | None], delivered: list[bool], seconds: float) -> None:
        """Finish a one-round cycle: scale the parts every rank sent, copy them out and complete their requests. The
        other parts' requests stay pending, with nothing in the timeline: to them the round was a negotiation."""
        every = zip(plan.responses, requests, plan.parts, plan.sizes, delivered, strict=True)
        kept = [(response, request, part, size) for response, request, part, size, ok in every if ok and request is not None]
        if not kept:
            return
        done = [response for response, _, _, _ in kept]
        self._mark_round(done)
        self._begin(done, "MEMCPY_OUT_FUSION_BUFFER")
        try:
            for _, request, part, _ in kept:
                assert request is not None
                if request.output is not None:
                    _scale_into(part, plan.postscale, request.output.view(-1))
        except Exception as error:
            names = ", ".join(repr(r.name) for r in done)
            message = f"Shoal could not complete allreduce of {names} on rank {self.rank}: {error}"
            get_logger().error("%s", message)
            for _, request, _, _ in kept:
                assert request is not None
                request.fail(RuntimeError(message))
            return
        finally:
            self._end(done, "MEMCPY_OUT_FUSION_BUFFER")
            self._end(done, "ALLREDUCE")
        self._record_seconds(done, seconds, [size for _, _, _, size in kept])
        for _, request, _, _ in kept:
            assert request is not None
            request.complete(request.output)

    def _mark_round(self, done: list[Response]) -> None:
        """Timeline rows of the requests a one-round cycle completed: their negotiation ended when the round began,
        which was also their allreduce's wire phase."""
        timeline = self._timeline()
        if timeline is None:
            return
        started_us, ended_us, phase = self._round_us
        for response in done:
            timeline.end(response.name, f"NEGOTIATE_{response.kind.value.upper()}", started_us)
            timeline.begin(response.name, "ALLREDUCE", {"one_round": True}, started_us)
            timeline.begin(response.name, phase, None, started_us)
            timeline.end(response.name, phase, ended_us)

    def _adasum_(self, buffer: torch.Tensor, sizes: list[int], state: ProcessSetState, name: str) -> None:
        """Adasum in place: gather every member's buffer, then combine each tensor's slices along the same tree on
        every rank (identical float operations, so identical results). Moves members x the bytes of a ring
        allreduce; Horovod's recursive halving moves fewer, but needs a power-of-two world."""
        with self._wire(f"adasum allreduce '{name}'"):
            gathered = collectives.allgather_equal(buffer, len(state.members), state.group)
        offset = 0
        for count in sizes:
            buffer[offset : offset + count] = adasum.reduce_tree([part[offset : offset + count] for part in gathered])
            offset += count

    def _uses_shared_memory(self, buffer: torch.Tensor, process_set: int) -> bool:
        return self.hierarchical is not None and self.use_hierarchical and process_set == 0 and not buffer.is_cuda

    def _reduce_phase(self, buffer: torch.Tensor, process_set: int) -> str:
        """The timeline name of the path ``_reduce_`` takes for this buffer."""
        if self.hierarchical is not None and self._uses_shared_memory(buffer, process_set):
            return "SHM_ALLREDUCE" if self.hierarchical.cross_size == 1 else "HIERARCHICAL_ALLREDUCE"
        return "NCCL_ALLREDUCE" if buffer.is_cuda else "GLOO_ALLREDUCE"

    def _reduce_(
        self,
        buffer: torch.Tensor,
        reduction: str,
        process_set: int,
        state: ProcessSetState,
        name: str,
        finish: Callable[[torch.Tensor], None] | None = None,
    ) -> bool:
        """Allreduce ``buffer`` in place: shared memory (hierarchical) for CPU tensors of the world, else gloo/NCCL.

        Returns True when ``finish`` (an elementwise step on the reduced values) was applied inside the shared-memory
        collective, each rank on its slice; False when the caller must apply it to the whole buffer.
        """
        wire = _real_view(buffer)
        with self._wire(f"allreduce '{name}'"):
            if self.hierarchical is not None and self._uses_shared_memory(buffer, process_set):
                self.hierarchical.allreduce_(wire, reduction, finish)
                return finish is not None
            collectives.allreduce_(wire, reduction, state.group)
            return False

    def _allgather(self, response: Response, request: Request | None, state: ProcessSetState) -> None:
        rows = [(m.shape[0] if m.shape else 1) if m is not None else 0 for m in (response.rank_metas[r] for r in state.members)]
        given = self._input(response, request, rows=rows[state.members.index(self.rank)])
        own = bit_view(given)
        dtype = own.dtype
        wire = _WIRE_DTYPES.get(dtype, dtype)
        longest = max(rows)
        padded = torch.zeros((longest, *own.shape[1:]), dtype=wire, device=own.device)
        padded[: own.shape[0] if own.dim() else 1].copy_(own.reshape(-1, *own.shape[1:]) if own.dim() else own.reshape(1))
        with self._wire(f"allgather '{response.name}'"):
            chunks = collectives.allgather_equal(_real_view(padded), len(state.members), state.group)
        if padded.is_complex():
            chunks = [torch.view_as_complex(chunk) for chunk in chunks]
        result = torch.cat([chunk[:count] for chunk, count in zip(chunks, rows, strict=True)]).to(dtype).view(given.dtype)
        if request is not None:
            request.complete(result)

    def _broadcast(self, response: Response, request: Request | None, state: ProcessSetState) -> None:
        root = response.meta.root
        assert root is not None
        buffer = self._input(response, request)
        if request is not None and request.output is not None and request.output is not buffer:
            request.output.copy_(buffer)
            buffer = request.output
        bits = bit_view(buffer)
        wire = _WIRE_DTYPES.get(bits.dtype)
        moved = bits.to(wire) if wire is not None else bits
        with self._wire(f"broadcast '{response.name}'"):
            collectives.broadcast_(_real_view(moved), root, state.group)
        if moved is not bits:
            bits.copy_(moved)
        if request is not None:
            request.complete(buffer)

    def _alltoall(self, response: Response, request: Request | None, state: ProcessSetState) -> None:
        members = state.members
        me = members.index(self.rank)

        def splits_of(meta: RequestMeta | None) -> list[int]:
            if meta is None:
                return [0] * len(members)
            if meta.splits is not None:
                return list(meta.splits)
            return split_rows(meta.shape[0] if meta.shape else 0, len(members))

        send = splits_of(response.rank_metas[self.rank])
        receive = [splits_of(response.rank_metas[member])[me] for member in members]
        given = self._input(response, request, rows=sum(send))
        tensor = bit_view(given)
        wire = _WIRE_DTYPES.get(tensor.dtype, tensor.dtype)
        output = torch.empty((sum(receive), *tensor.shape[1:]), dtype=wire, device=tensor.device)
        with self._wire(f"alltoall '{response.name}'"):
            collectives.alltoall(_real_view(output), _real_view(tensor.to(wire)), receive, send, state.group)
        if request is not None:
            request.complete((output.to(tensor.dtype).view(given.dtype), torch.tensor(receive, dtype=torch.int32)))

    def _reducescatter(self, response: Response, request: Request | None, state: ProcessSetState) -> None:
        meta = response.meta
        tensor = self._input(response, request)
        wire = _WIRE_DTYPES.get(tensor.dtype, tensor.dtype)
        buffer = tensor.to(wire, copy=True)
        _scale_(buffer, meta.prescale)
        assert meta.op is not None  # allreduce and reducescatter requests always carry their op
        op = ReduceOp(meta.op)
        self._reduce_(buffer, _REDUCTIONS[op], response.process_set, state, response.name)
        _postscale_(buffer, op, meta.postscale, len(state.members))
        counts = split_rows(buffer.shape[0], len(state.members))
        me = state.members.index(self.rank)
        start = sum(counts[:me])
        if request is not None:
            request.complete(buffer[start : start + counts[me]].to(tensor.dtype).clone())

    def _manage_process_set(self, response: Response, request: Request | None) -> None:
        meta = response.meta
        if response.kind == Kind.ADD_PROCESS_SET:
            members = tuple(meta.payload or ())
            existing = [pid for pid, s in self.process_sets.items() if s.members == members]
            if existing:
                if request is not None:
                    request.fail(ValueError(f"a process set with ranks {list(members)} already exists (id {existing[0]})"))
                return
            # new_group is collective over the world: every rank creates it, members or not.
            with self._wire(f"creating process set {list(members)}"):
                group = collectives.new_group(list(members), self._group_timeout_s)
            set_id = self.next_process_set_id
            self.next_process_set_id += 1
            self.process_sets[set_id] = ProcessSetState(members, group)
            if request is not None:
                request.complete(set_id)
        else:
            set_id = (meta.payload or (-1,))[0]
            state = self.process_sets.pop(set_id, None)
            if state is not None and state.group is not None and self.rank in state.members:
                with self._wire(f"removing process set {set_id}"):
                    collectives.destroy_group(state.group)
            if request is not None:
                request.complete(state is not None)
