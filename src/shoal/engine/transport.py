"""The engine's transport: its groups, the shared-memory (hierarchical) path, registered arenas and process sets.

One per engine, made before the first cycle and handed to the executor. Every collective the engine issues goes
through a group or path this object owns, and ``release`` closes them all when the engine thread ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shoal.comm import collectives
from shoal.comm.hierarchical import HierarchicalAllreduce, build_cross_groups
from shoal.comm.names import host_tag
from shoal.comm.shared_arena import SharedArena
from shoal.comm.shm import SharedMemoryGroup, create_local_group
from shoal.engine.buffers import real_view
from shoal.engine.config import EngineConfig
from shoal.engine.negotiation import Response
from shoal.engine.request import ReduceOp, Request, RequestMeta
from shoal.engine.stall import CollectiveWatch
from shoal.exceptions import HorovodInternalError
from shoal.log import get_logger
from shoal.runtime.topology import Topology


class TransportError(RuntimeError):
    """A collective on the wire failed (a peer died, a timeout): the engine cannot go on."""


@dataclass
class ProcessSetState:
    """A registered process set: its global ranks (ascending) and its torch.distributed group."""

    members: tuple[int, ...]
    group: Any


@dataclass(frozen=True)
class ArenaSite:
    """What a rank needs to create and check its host's shared-memory arenas."""

    token: str
    """The job's part of segment names."""
    host: str
    """The host's part of segment names."""
    local_rank: int
    local_size: int


class Transport:
    """The groups and paths of one engine."""

    def __init__(
        self,
        topology: Topology,
        config: EngineConfig,
        store: Any,
        job: str,
        watch: CollectiveWatch,
        connect_timeout_s: float | None = None,
    ) -> None:
        """``connect_timeout_s``: how long creating a group may wait for a member's connection (an elastic round's
        member that died while the round formed never connects); None: as long as a collective."""
        self.rank = topology.rank
        self.size = topology.size
        self.watch = watch
        self.timeout_s = config.transport_timeout_s
        self.connect_timeout_s = connect_timeout_s
        # The engine owns a group of its own, so that the user's own torch.distributed calls on the default group
        # (DDP, a raw all_reduce) never interleave with the engine's collectives on the same connections.
        # Every group gets an explicit timeout (torch's default is 30 minutes); see EngineConfig.collective_timeout_s.
        self.world: Any = collectives.new_group(list(range(self.size)), self.timeout_s, connect_timeout_s)
        self._job = job
        self._host = host_tag(topology.host_of_rank[self.rank])
        self.hierarchical = self._setup_hierarchical(topology, config, store, job)
        self.process_sets: dict[int, ProcessSetState] = {0: ProcessSetState(tuple(range(self.size)), self.world)}
        self.next_process_set_id = 1
        self.use_hierarchical = True
        """Autotune may turn the shared-memory path off (and on) for data, on every rank in the same cycle."""
        self.arenas: dict[str, SharedArena] = {}
        """This rank's registered shared-memory arenas by key (``RequestMeta.shared``), mapped with the host's peers'."""
        self.reached_wire = False
        """Whether the current batch has reached the wire (``wire``); the executor resets it per batch."""

    def _setup_hierarchical(
        self, topology: Topology, config: EngineConfig, store: Any, job: str
    ) -> HierarchicalAllreduce | None:
        """Shared memory within hosts when asked for (or by default when a host has several ranks), agreed by all."""
        wanted = config.hierarchical_allreduce
        if wanted is False or topology.local_size == 1 or store is None:
            return None
        if not topology.is_homogeneous:
            if self.rank == 0:
                get_logger().warning("hierarchical allreduce needs the same number of ranks on every host; using gloo")
            return None
        local = create_local_group(
            store,
            topology.local_rank,
            topology.local_size,
            topology.host_of_rank[self.rank],
            job,
            config.shm_slot_bytes,
            config.transport_timeout_s,
        )
        # Every host must take the same path, or the collectives would not pair up.
        available = torch.tensor([1 if local is not None else 0], dtype=torch.int64)
        collectives.allreduce_(available, "min", self.world)
        everywhere = bool(available.item())
        if not everywhere:
            if local is not None:
                local.close()
            return None
        cross_group = None
        if topology.cross_size > 1:
            cross_groups = build_cross_groups(
                topology.local_rank_of_rank, topology.local_size, self.timeout_s, self.connect_timeout_s
            )
            cross_group = cross_groups[topology.local_rank]
        assert local is not None
        return HierarchicalAllreduce(local, cross_group, topology.cross_size)

    def members_of(self) -> dict[int, tuple[int, ...]]:
        """Each process set's members, by id."""
        return {set_id: state.members for set_id, state in self.process_sets.items()}

    # ----- shared-memory arenas -----

    def arena_site(self) -> ArenaSite | None:
        """Where this rank's shared-memory arenas live (``shoal.comm.shared_arena``); None when the engine reduces
        without shared memory (one rank per host, hierarchical allreduce off or unavailable). Agreed by all ranks."""
        if self.hierarchical is None:
            return None
        local = self.hierarchical.local
        return ArenaSite(self._job, self._host, local.local_rank, local.local_size)

    def register_arena(self, key: str, arena: SharedArena) -> None:
        """From now on, allreduces that name ``key`` in ``RequestMeta.shared`` are ranges of ``arena``."""
        if key in self.arenas:
            raise ValueError(f"shared arena {key!r} is already registered")
        self.arenas[key] = arena

    def arena_for(
        self, responses: list[Response], request: Request | None, state: ProcessSetState, joined: frozenset[int]
    ) -> SharedArena | None:
        """The arena to reduce in place, when every member's request is the same range of a registered arena and the
        shared-memory path is on; else None (the ordinary path, which is right for any tensor).

        Every rank decides from the agreed response and settings alone, so all take the same path.
        """
        meta = responses[0].meta
        if len(responses) != 1 or meta.shared is None or meta.prescale != 1.0 or meta.op == ReduceOp.Adasum:
            return None
        rank_metas = [responses[0].rank_metas[member] for member in state.members]
        if joined.intersection(state.members) or any(m is None or m.shared != meta.shared for m in rank_metas):
            return None  # a rank that joined (a cached response lists it still), or one whose gradient is elsewhere
        if request is None or request.tensor is None or not self.uses_shared_memory(request.tensor, meta.process_set):
            return None
        arena = self.arenas.get(meta.shared[0])
        if arena is None:
            raise HorovodInternalError(f"allreduce '{meta.name}' names shared arena {meta.shared[0]!r}, not registered here")
        return arena

    def reduce_arena_(
        self,
        arena: SharedArena,
        meta: RequestMeta,
        tensor: torch.Tensor,
        reduction: str,
        finish: Callable[[torch.Tensor], None] | None,
    ) -> None:
        """Reduce ``tensor``, a range of every local rank's ``arena``, in place: no fusion buffer, no copy in or out."""
        assert meta.shared is not None and self.hierarchical is not None
        offset = meta.shared[1]
        if tensor.data_ptr() != arena.own().data_ptr() + offset:
            raise HorovodInternalError(f"allreduce '{meta.name}': the tensor is not its arena's range at byte {offset}")
        with self.wire(f"allreduce '{meta.name}'"):
            self.hierarchical.allreduce_arena_(arena, offset, tensor.dtype, tensor.numel(), reduction, finish)

    # ----- the data path -----

    @contextlib.contextmanager
    def wire(self, what: str) -> Iterator[None]:
        """Around every call that talks to peers: watched while it blocks, and any failure is a TransportError."""
        self.reached_wire = True
        try:
            with self.watch.watching(what):
                yield
        except TransportError:
            raise
        except Exception as error:
            raise TransportError(f"{what} failed: {error}") from error

    def uses_shared_memory(self, buffer: torch.Tensor, process_set: int) -> bool:
        return self.hierarchical is not None and self.use_hierarchical and process_set == 0 and not buffer.is_cuda

    def reduce_phase(self, buffer: torch.Tensor, process_set: int) -> str:
        """The timeline name of the path ``reduce_`` takes for this buffer."""
        if self.hierarchical is not None and self.uses_shared_memory(buffer, process_set):
            return "SHM_ALLREDUCE" if self.hierarchical.cross_size == 1 else "HIERARCHICAL_ALLREDUCE"
        return "NCCL_ALLREDUCE" if buffer.is_cuda else "GLOO_ALLREDUCE"

    def reduce_(
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
        wire = real_view(buffer)
        with self.wire(f"allreduce '{name}'"):
            if self.hierarchical is not None and self.uses_shared_memory(buffer, process_set):
                self.hierarchical.allreduce_(wire, reduction, finish)
                return finish is not None
            collectives.allreduce_(wire, reduction, state.group)
            return False

    def shared_blocks(self, buffer: torch.Tensor, process_set: int) -> SharedMemoryGroup | None:
        """The host's shared-memory group where a set's blocks (a reduce-scatter's, an allgather's) can move through
        it: the world on one host (a block per local rank, in rank order), real dtypes; else None."""
        hierarchical = self.hierarchical
        if hierarchical is None or hierarchical.cross_size != 1 or buffer.is_complex():
            return None
        return hierarchical.local if self.uses_shared_memory(buffer, process_set) else None

    def and_words_(self, words: torch.Tensor) -> None:
        """The cycle's bit vector, ANDed across the world in place (through shared memory where it is set up)."""
        if self.hierarchical is not None:
            self.hierarchical.allreduce_(words, "band")
        else:
            collectives.bitwise_and_(words, self.world)

    # ----- process sets -----

    def find_set(self, members: tuple[int, ...]) -> int | None:
        """The id of the process set of exactly these ranks, if one is registered."""
        return next((set_id for set_id, state in self.process_sets.items() if state.members == members), None)

    def add_set(self, members: tuple[int, ...]) -> int:
        """Register a process set; every rank calls this in the same cycle (``new_group`` is collective)."""
        with self.wire(f"creating process set {list(members)}"):
            group = collectives.new_group(list(members), self.timeout_s, self.connect_timeout_s)
        set_id = self.next_process_set_id
        self.next_process_set_id += 1
        self.process_sets[set_id] = ProcessSetState(members, group)
        return set_id

    def remove_set(self, set_id: int) -> bool:
        """Forget a process set and release its group; False when no such set is registered."""
        state = self.process_sets.pop(set_id, None)
        if state is not None and state.group is not None and self.rank in state.members:
            with self.wire(f"removing process set {set_id}"):
                collectives.destroy_group(state.group)
        return state is not None

    # ----- the end -----

    def release(self) -> None:
        """Close this rank's side of every connection, as soon as the engine thread ends.

        A peer blocked on this rank (say, rank 0 waiting for rank 1 while rank 1 saw rank 2 die) must fail at once
        rather than at the gloo timeout: it is what lets elastic survivors re-form promptly. A gloo group's sockets
        close only when the last reference to it goes (``abort()`` and ``shutdown()`` leave them open), so the
        transport drops all of its references; leaving the shared-memory segment marks this rank as gone for the
        others' liveness checks.
        """
        hierarchical, self.hierarchical = self.hierarchical, None
        groups = [state.group for state in self.process_sets.values() if state.group is not None and self.rank in state.members]
        if hierarchical is not None:
            hierarchical.close()
            if hierarchical.cross_group is not None:
                groups.append(hierarchical.cross_group)
        self.process_sets.clear()
        for arena in self.arenas.values():
            arena.close()
        self.arenas.clear()
        self.world = None
        for group in groups:
            try:
                collectives.destroy_group(group)
            except (RuntimeError, ValueError) as error:  # already gone with the default group
                get_logger().debug("engine group already released: %s", error)
        del groups, hierarchical
        gc.collect()  # engine objects refer to each other; free the groups now, not at some later collection
