"""The hosts as local steps see them: each host's ranks (the inner exchange) and one rank per host (the outer
exchange), registered as process sets once per ``init()``; and what ``DistributedOptimizer(comm="local")`` needs of
its other arguments."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shoal.core.process_sets import ProcessSet, add_process_set, global_process_set
from shoal.core.rules import ReduceOp
from shoal.plan.far import LocalSteps
from shoal.plan.schemes import Planned, Scheme, forces_outer, takes_outer
from shoal.runtime import context
from shoal.runtime.topology import Topology

_GROUPS_PART = "torch.local_steps.groups"


@dataclass(frozen=True)
class HostGroups:
    """The process sets local steps run on: each host's ranks (the inner exchange), and one rank per host (the outer
    exchange)."""

    inner: ProcessSet
    """This host's ranks; a host of one rank gets a set it is not in, so that its exchange does nothing (as for a
    Horovod rank outside its optimizer's process set)."""
    leaders: ProcessSet | None
    """The first rank of every host, among whom the pseudo-gradient is averaged; None on a single host."""
    host: ProcessSet | None
    """This host's ranks when it has several (the averaged pseudo-gradient is broadcast in it), else None."""
    leader: bool
    """This rank is its host's first, and takes part in the outer exchange."""
    root: int
    """The global rank of this host's leader."""
    hosts: int

    @classmethod
    def register(cls) -> HostGroups:
        """The sets, registered once per ``init()`` (then kept for every optimizer). Collective: every rank registers
        every host's set, in the same order."""
        ctx = context.current()
        known: HostGroups | None = ctx.part(_GROUPS_PART)
        if known is None:
            known = cls._register(ctx.topology)
            ctx.set_part(_GROUPS_PART, known)
        return known

    @classmethod
    def _register(cls, topology: Topology) -> HostGroups:
        order: list[str] = []
        for host in topology.host_of_rank:
            if host not in order:
                order.append(host)
        members = {
            host: sorted(
                (r for r in range(topology.size) if topology.host_of_rank[r] == host),
                key=lambda r: topology.local_rank_of_rank[r],
            )
            for host in order
        }
        mine = members[topology.host_of_rank[topology.rank]]
        if len(order) == 1:  # one host: its set is the job's
            return cls(
                global_process_set,
                None,
                global_process_set if topology.size > 1 else None,
                mine[0] == topology.rank,
                mine[0],
                1,
            )
        host_sets = {host: add_process_set(ranks) for host, ranks in members.items() if len(ranks) > 1}
        leaders: ProcessSet | None = None
        if len(order) > 1:
            firsts = [members[host][0] for host in order]
            leaders = global_process_set if len(firsts) == topology.size else add_process_set(firsts)
        own = host_sets.get(topology.host_of_rank[topology.rank])
        return cls(own or ProcessSet([]), leaders, own, mine[0] == topology.rank, mine[0], len(order))


def local_options(mode: Scheme | Planned, every: int | None, options: LocalSteps | None, outer: object) -> LocalSteps | None:
    """The local steps' settings for ``comm="local"`` or ``"auto-far"`` (``every`` overrides ``options.every``), or
    None.

    Raises:
        ValueError: local steps' arguments with another ``comm``, or a bad value.
    """
    if not takes_outer(mode):
        if every is not None or options is not None or outer is not None:
            raise ValueError(
                f"every=, local_steps= and outer_optimizer= go with comm='local' or 'auto-far', not comm={mode.value!r}"
            )
        return None
    if options is not None and not isinstance(options, LocalSteps):
        raise ValueError(f"local_steps must be a shoal LocalSteps, got {type(options).__name__}")
    options = options or LocalSteps()
    if every is not None:
        options = dataclasses.replace(options, every=every)
    if outer is not None and not callable(outer):
        raise ValueError("outer_optimizer must be a callable that builds an optimizer from a list of parameters")
    return options


def check_local(op: ReduceOp, process_set: ProcessSet, compressed: bool, balanced: bool) -> None:
    """What local steps need of the optimizer's other arguments (``compressed``: compression or overrides, which
    ``comm="local"`` refuses).

    Raises:
        ValueError: an argument local steps cannot honour.
    """
    if op != ReduceOp.Average:
        raise ValueError(f"local steps average the hosts' weights: it needs op=Average, not {op.name}")
    if process_set is not global_process_set:
        raise ValueError("local steps run over the whole job (each host is one worker): leave process_set global")
    if compressed:
        raise ValueError("comm='local' sets every layer's exchange: it takes neither compression= nor comm_overrides=")
    if balanced:
        raise ValueError("local steps with a BalancedLoader are not supported yet")


def host_groups(
    mode: Scheme | Planned, local: LocalSteps | None, op: ReduceOp, process_set: ProcessSet, compressed: bool, balanced: bool
) -> HostGroups | None:
    """With local steps (forced or weighed): the arguments checked, and the host groups registered (collective);
    else None."""
    if local is None:
        return None
    check_local(op, process_set, compressed and forces_outer(mode), balanced)
    return HostGroups.register()
