"""Run agreed responses: copy into fusion buffers, issue the collective on the engine's ``Transport``, copy out."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shoal.comm import collectives
from shoal.comm.shared_arena import SharedArena
from shoal.comm.shm_blocks import allgather_blocks, reduce_scatter_
from shoal.engine import adasum
from shoal.engine.buffers import (
    REDUCTIONS,
    WIRE_DTYPES,
    bit_view,
    dtype_of,
    postscaler,
    real_view,
    scale_,
    split_rows,
)
from shoal.engine.buffers import postscale_ as _postscale_  # (a module name: tests replace it to fail one collective)
from shoal.engine.fusion import FusedBatch
from shoal.engine.negotiation import Response
from shoal.engine.request import DATA_KINDS, Kind, ReduceOp, Request, RequestMeta
from shoal.engine.timeline import Timeline
from shoal.engine.transport import ProcessSetState, Transport, TransportError
from shoal.exceptions import CollectiveMismatchError
from shoal.log import get_logger

_WIRED_KINDS = frozenset(kind.value for kind in (*DATA_KINDS, Kind.BARRIER, Kind.ADD_PROCESS_SET))


class Executor:
    """Executes batches of responses on this rank."""

    def __init__(self, transport: Transport, timeline: Callable[[], Timeline | None]) -> None:
        self.rank = transport.rank
        self.transport = transport
        self.timeline = timeline
        """The engine's current timeline, or None (it may change between cycles)."""
        self.collective_calls = 0
        self.joined: frozenset[int] = frozenset()
        """The ranks that have joined (they stand in for collectives with zeros), as every rank knows them."""
        self.executions: dict[tuple[int, str], tuple[float, int, int]] = {}
        """Per data request, its last execution: (its share by size of its batch's seconds, its elements, the
        batch's elements). The planner compares these with its predictions. Written by the engine thread only; a
        reader sees a whole tuple, new or old."""

    def begin_phase(self, responses: list[Response], phase: str) -> None:
        timeline = self.timeline()
        if timeline is not None:
            for response in responses:
                timeline.begin(response.name, phase)

    def end_phase(self, responses: list[Response], phase: str) -> None:
        timeline = self.timeline()
        if timeline is not None:
            for response in responses:
                timeline.end(response.name, phase)

    def run(self, batch: FusedBatch, local: dict[tuple[int, str], Request]) -> None:
        """Execute one batch; completes (or fails) this rank's requests in it.

        A failure after the wire (scaling, copying results out) fails this batch's requests alone, with an error
        naming them; the engine goes on. A failure on the wire raises ``TransportError``: the peers' state is
        unknown then, and the engine must stop. So does a failure before the wire (say, no memory for the fusion
        buffer): the peers are already inside that collective, and this rank skipping it would pair its next
        collective with theirs. Deterministic errors never get that far: requests are validated at submission.
        """
        requests = [local.pop((r.process_set, r.name), None) for r in batch.responses]
        self.transport.reached_wire = False
        try:
            self._run(batch, requests)
        except TransportError:
            raise
        except Exception as error:
            names = ", ".join(f"'{r.name}'" for r in batch.responses)
            kind = batch.responses[0].kind.value
            if not self.transport.reached_wire and batch.responses[0].error is None and kind in _WIRED_KINDS:
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
        state = self.transport.process_sets[first.process_set]
        if self.rank not in state.members:
            return
        phase = f"{first.kind.value.upper()}"
        self.collective_calls += 1
        self.begin_phase(batch.responses, phase)
        started = time.perf_counter()
        try:
            if first.kind == Kind.ALLREDUCE:
                self._allreduce(batch.responses, requests, state)
            elif first.kind == Kind.ALLGATHER:
                _allgather(self.transport, first, requests[0], state)
            elif first.kind == Kind.BROADCAST:
                _broadcast(self.transport, first, requests[0], state)
            elif first.kind == Kind.ALLTOALL:
                _alltoall(self.transport, first, requests[0], state)
            elif first.kind == Kind.REDUCESCATTER:
                _reducescatter(self.transport, first, requests[0], state)
            elif first.kind == Kind.BARRIER:
                with self.transport.wire(f"barrier '{first.name}'"):
                    collectives.barrier(state.group)
                if requests[0] is not None:
                    requests[0].complete(None)
        finally:
            self.end_phase(batch.responses, phase)
        self.record_seconds(batch.responses, time.perf_counter() - started)

    def record_seconds(self, responses: list[Response], seconds: float, sizes: list[int] | None = None) -> None:
        """Each response's share by size of a batch's ``seconds`` (``sizes``: their elements, when already known)."""
        if sizes is None:
            sizes = [math.prod(r.meta.shape) for r in responses]
        total = sum(sizes)
        for response, size in zip(responses, sizes, strict=True):
            share = size / total if total else 1 / len(responses)
            self.executions[(response.process_set, response.name)] = (seconds * share, size, total)

    def _allreduce(self, responses: list[Response], requests: list[Request | None], state: ProcessSetState) -> None:
        meta = responses[0].meta
        dtype = dtype_of(meta)
        wire = WIRE_DTYPES.get(dtype, dtype)
        arena = self.transport.arena_for(responses, requests[0], state, self.joined)
        if arena is not None:
            self._allreduce_in_arena(responses[0], requests[0], state, arena)
            return
        inputs = [_input(r, q) for r, q in zip(responses, requests, strict=True)]
        single_in_place = (
            len(responses) == 1 and requests[0] is not None and requests[0].output is requests[0].tensor and wire == dtype
        )
        self.begin_phase(responses, "MEMCPY_IN_FUSION_BUFFER")
        if single_in_place:
            buffer = inputs[0].view(-1)
        elif wire != dtype:
            buffer = torch.cat([tensor.reshape(-1).to(wire) for tensor in inputs])
        else:  # one C++ call flattens and concatenates every input
            buffer = _flatten_dense_tensors(inputs) if len(inputs) > 1 else inputs[0].reshape(-1).clone()
        scale_(buffer, meta.prescale)
        self.end_phase(responses, "MEMCPY_IN_FUSION_BUFFER")
        assert meta.op is not None  # allreduce and reducescatter requests always carry their op
        op = ReduceOp(meta.op)
        if op == ReduceOp.Adasum:
            self.begin_phase(responses, "ADASUM_ALLREDUCE")
            self._adasum_(buffer, [tensor.numel() for tensor in inputs], state, responses[0].name)
            self.end_phase(responses, "ADASUM_ALLREDUCE")
            _postscale_(buffer, op, meta.postscale, len(state.members))
            scaled = True
        else:
            phase = self.transport.reduce_phase(buffer, responses[0].process_set)
            self.begin_phase(responses, phase)
            members = len(state.members)
            scaled = self.transport.reduce_(
                buffer,
                REDUCTIONS[op],
                responses[0].process_set,
                state,
                responses[0].name,
                postscaler(op, meta.postscale, members),
            )
            self.end_phase(responses, phase)
        self.begin_phase(responses, "MEMCPY_OUT_FUSION_BUFFER")
        if not scaled:
            _postscale_(buffer, op, meta.postscale, len(state.members))
        if not single_in_place:
            pieces = _unflatten_dense_tensors(buffer, inputs)  # views of the buffer, shaped as the inputs
            kept = [
                (q.output, p)
                for q, p in zip(requests, pieces, strict=True)
                if q is not None and q.output is not None and p.numel()
            ]  # (an empty piece may come back flat from older torch: nothing to copy)
            if kept:
                # One multi-tensor copy instead of a Python-level copy per tensor (a cast only off the wire dtype).
                sources = [piece for _, piece in kept] if wire == dtype else [piece.to(out.dtype) for out, piece in kept]
                torch._foreach_copy_([out for out, _ in kept], sources)
        for request in requests:
            if request is not None:
                request.complete(request.output)
        self.end_phase(responses, "MEMCPY_OUT_FUSION_BUFFER")

    def _allreduce_in_arena(
        self, response: Response, request: Request | None, state: ProcessSetState, arena: SharedArena
    ) -> None:
        """Reduce a range of every local rank's arena in place (``Transport.reduce_arena_``)."""
        meta = response.meta
        assert request is not None and request.tensor is not None and meta.op is not None
        phase = self.transport.reduce_phase(request.tensor, meta.process_set)
        self.begin_phase([response], phase)
        op = ReduceOp(meta.op)
        finish = postscaler(op, meta.postscale, len(state.members))
        self.transport.reduce_arena_(arena, meta, request.tensor, REDUCTIONS[op], finish)
        self.end_phase([response], phase)
        request.complete(request.output)

    def _adasum_(self, buffer: torch.Tensor, sizes: list[int], state: ProcessSetState, name: str) -> None:
        """Adasum in place: gather every member's buffer, then combine each tensor's slices along the same tree on
        every rank (identical float operations, so identical results). Moves members x the bytes of a ring
        allreduce; Horovod's recursive halving moves fewer, but needs a power-of-two world."""
        with self.transport.wire(f"adasum allreduce '{name}'"):
            gathered = collectives.allgather_equal(buffer, len(state.members), state.group)
        offset = 0
        for count in sizes:
            buffer[offset : offset + count] = adasum.reduce_tree([part[offset : offset + count] for part in gathered])
            offset += count

    def _manage_process_set(self, response: Response, request: Request | None) -> None:
        meta = response.meta
        if response.kind == Kind.ADD_PROCESS_SET:
            members = tuple(meta.payload or ())
            existing = self.transport.find_set(members)
            if existing is not None:
                if request is not None:
                    request.fail(ValueError(f"a process set with ranks {list(members)} already exists (id {existing})"))
                return
            # new_group is collective over the world: every rank creates it, members or not.
            set_id = self.transport.add_set(members)
            if request is not None:
                request.complete(set_id)
        else:
            removed = self.transport.remove_set((meta.payload or (-1,))[0])
            if request is not None:
                request.complete(removed)


def _input(response: Response, request: Request | None, rows: int | None = None) -> torch.Tensor:
    """This rank's input for a response, or zeros when it joined and submitted nothing."""
    if request is not None and request.tensor is not None:
        return request.tensor
    meta = response.meta
    shape = (rows, *meta.shape[1:]) if rows is not None else meta.shape
    # Requests name the device type only; "cuda" is this rank's current device, as each rank has its own.
    return torch.zeros(shape, dtype=dtype_of(meta), device=meta.device)


def _allgather(transport: Transport, response: Response, request: Request | None, state: ProcessSetState) -> None:
    rows = [(m.shape[0] if m.shape else 1) if m is not None else 0 for m in (response.rank_metas[r] for r in state.members)]
    given = _input(response, request, rows=rows[state.members.index(transport.rank)])
    own = bit_view(given)
    dtype = own.dtype
    wire = WIRE_DTYPES.get(dtype, dtype)
    mine = own.reshape(-1, *own.shape[1:]) if own.dim() else own.reshape(1)
    local = transport.shared_blocks(mine, response.process_set)
    if local is not None:  # one host: each rank writes its rows once and reads the others'
        with transport.wire(f"allgather '{response.name}'"):
            whole = allgather_blocks(local, mine.to(wire).reshape(-1), [count * math.prod(own.shape[1:]) for count in rows])
        gathered = whole.view(sum(rows), *own.shape[1:])
    else:  # gloo's allgather takes equal shapes: pad every rank's rows to the longest
        padded = torch.zeros((max(rows), *own.shape[1:]), dtype=wire, device=own.device)
        padded[: mine.shape[0]].copy_(mine)
        with transport.wire(f"allgather '{response.name}'"):
            chunks = collectives.allgather_equal(real_view(padded), len(state.members), state.group)
        if padded.is_complex():
            chunks = [torch.view_as_complex(chunk) for chunk in chunks]
        gathered = torch.cat([chunk[:count] for chunk, count in zip(chunks, rows, strict=True)])
    result = gathered.to(dtype).view(given.dtype)
    if request is not None:
        request.complete(result)


def _broadcast(transport: Transport, response: Response, request: Request | None, state: ProcessSetState) -> None:
    root = response.meta.root
    assert root is not None
    buffer = _input(response, request)
    if request is not None and request.output is not None and request.output is not buffer:
        request.output.copy_(buffer)
        buffer = request.output
    bits = bit_view(buffer)
    wire = WIRE_DTYPES.get(bits.dtype)
    moved = bits.to(wire) if wire is not None else bits
    with transport.wire(f"broadcast '{response.name}'"):
        collectives.broadcast_(real_view(moved), root, state.group)
    if moved is not bits:
        bits.copy_(moved)
    if request is not None:
        request.complete(buffer)


def _alltoall(transport: Transport, response: Response, request: Request | None, state: ProcessSetState) -> None:
    members = state.members
    me = members.index(transport.rank)

    def splits_of(meta: RequestMeta | None) -> list[int]:
        if meta is None:
            return [0] * len(members)
        if meta.splits is not None:
            return list(meta.splits)
        return split_rows(meta.shape[0] if meta.shape else 0, len(members))

    send = splits_of(response.rank_metas[transport.rank])
    receive = [splits_of(response.rank_metas[member])[me] for member in members]
    given = _input(response, request, rows=sum(send))
    tensor = bit_view(given)
    wire = WIRE_DTYPES.get(tensor.dtype, tensor.dtype)
    output = torch.empty((sum(receive), *tensor.shape[1:]), dtype=wire, device=tensor.device)
    with transport.wire(f"alltoall '{response.name}'"):
        collectives.alltoall(real_view(output), real_view(tensor.to(wire)), receive, send, state.group)
    if request is not None:
        request.complete((output.to(tensor.dtype).view(given.dtype), torch.tensor(receive, dtype=torch.int32)))


def _reducescatter(transport: Transport, response: Response, request: Request | None, state: ProcessSetState) -> None:
    meta = response.meta
    tensor = _input(response, request)
    wire = WIRE_DTYPES.get(tensor.dtype, tensor.dtype)
    assert meta.op is not None  # allreduce and reducescatter requests always carry their op
    op = ReduceOp(meta.op)
    counts = split_rows(tensor.shape[0], len(state.members))
    source = tensor.to(wire)  # a copy only where the wire carries another dtype; the transport never writes it
    block = _scattered(transport, source, meta.prescale, REDUCTIONS[op], counts, response, state)
    _postscale_(block, op, meta.postscale, len(state.members))
    if request is not None:
        request.complete(block.to(tensor.dtype))


def _scattered(
    transport: Transport,
    source: torch.Tensor,
    prescale: float,
    reduction: str,
    rows: list[int],
    response: Response,
    state: ProcessSetState,
) -> torch.Tensor:
    """This rank's block of rows of ``source`` times ``prescale``, reduced across the set (rank i's block:
    ``rows[i]`` rows after the blocks before it), as a new tensor; ``source`` is left as it was. One host: through
    shared memory, each rank reducing only its block; over gloo, a ring. Else (NCCL, or shared memory with several
    hosts) an allreduce of a copy, sliced."""
    me = state.members.index(transport.rank)
    local = transport.shared_blocks(source, response.process_set)
    # Over gloo (between hosts, one rank each): a ring sends (N-1)/N of the bytes, an allreduce twice that.
    ring = not source.is_cuda and not source.is_complex() and not transport.uses_shared_memory(source, response.process_set)
    if local is not None or ring:
        flat = source.reshape(-1)
        if prescale != 1.0:
            flat = flat.clone()
            scale_(flat, prescale)
        elements = [count * math.prod(source.shape[1:]) for count in rows]
        with transport.wire(f"reducescatter '{response.name}'"):
            if local is not None:
                block = reduce_scatter_(local, flat, reduction, elements)
            else:
                block = collectives.ring_reduce_scatter(flat, elements, reduction, list(state.members), state.group)
        return block.view(rows[me], *source.shape[1:])
    buffer = source.clone()
    scale_(buffer, prescale)
    transport.reduce_(buffer, reduction, response.process_set, state, response.name)
    start = sum(rows[:me])
    return buffer[start : start + rows[me]].clone()  # not a view: the whole buffer is freed


__all__ = ["Executor", "ProcessSetState", "TransportError", "split_rows"]
