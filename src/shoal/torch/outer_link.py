"""The outer exchange across hosts for ``shoal.torch.local_steps``: a fragment's pseudo-gradient sent in its codec by
one rank per host, and the hosts' mean it comes back as, the same on every rank of every host."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shoal.core.rules import ReduceOp
from shoal.core.session import synchronize
from shoal.plan.outer_wire import Codec
from shoal.torch import functions
from shoal.torch.host_groups import HostGroups
from shoal.torch.outer_codec import Feedback, decode, padded_buffer


@dataclass
class Pending:
    """A fragment's outer exchange on its way."""

    handles: list[int]
    """The engine's handles (a host's first rank), none elsewhere."""
    codec: Codec
    fragment: int
    count: int
    """The fragment's entries."""
    weights: torch.Tensor
    """The fragment's weights on this rank when it was sent: the inner steps since are kept on top of the update."""
    round: int
    sent_at: float
    sent_step: int
    """The inner step count when it was sent: the inner steps it carries are those before."""
    age: int = 0
    """Inner steps since it was sent."""
    done_at: float | None = None
    """When the inner steps first saw it done (polled after each step)."""
    stats: int | None = None
    """The handle of the measured times sent with a round's last fragment (the slowest rank's, for ``replan``)."""


class OuterLink:
    """The hosts' link for one optimizer's outer exchanges: the lossy codecs' residuals (per fragment, this host's),
    a decode buffer, and the bytes sent."""

    def __init__(self, groups: HostGroups) -> None:
        self.groups = groups
        self.feedback: dict[int, Feedback] = {}
        self._work: torch.Tensor | None = None
        self.sent_bytes = 0
        """Bytes this rank sent in outer exchanges (its codec's payload)."""

    def regroup(self, groups: HostGroups) -> None:
        """The job re-formed: the hosts' new sets; the residuals were this host's debt to the old job's exchange."""
        self.groups = groups
        self.feedback.clear()

    def send(self, codec: Codec, fragment: int, delta: torch.Tensor, weights: torch.Tensor, round: int, step: int) -> Pending:
        """Start averaging a fragment's pseudo-gradient ``delta`` across hosts (a host's first rank sends; the others
        only wait for the result)."""
        groups = self.groups
        handles: list[int] = []
        if groups.leaders is not None and groups.leader:
            name = f"shoal.outer.{round}.{fragment}"
            # A re-plan may change the codec: what rounding left out so far goes on with the next exchange.
            if codec is Codec.FP32:
                carried = self.feedback.pop(fragment, None)
                if carried is not None and carried.residual is not None:
                    delta = delta + carried.residual
                payload = [delta]
                handles = [functions.allreduce_async(delta, name=name, op=ReduceOp.Average, process_set=groups.leaders)]
            else:
                feedback = self.feedback.get(fragment)
                if feedback is None or feedback.codec is not codec:
                    residual = feedback.residual if feedback is not None else None
                    feedback = self.feedback[fragment] = Feedback(codec, residual)
                payload = feedback.encode(delta)
                handles = [
                    functions.allgather_async(part.unsqueeze(0), name=f"{name}.{index}", process_set=groups.leaders)
                    for index, part in enumerate(payload)
                ]
            self.sent_bytes += sum(part.numel() * part.element_size() for part in payload)
        return Pending(handles, codec, fragment, delta.numel(), weights, round, time.perf_counter(), step)

    def mean(self, pending: Pending) -> torch.Tensor:
        """The hosts' mean pseudo-gradient of the fragment, the same on every rank (summed in host order)."""
        groups, count = self.groups, pending.count
        if pending.handles:
            results = [synchronize(handle) for handle in pending.handles]
            if pending.codec is Codec.FP32:
                mean = results[0]
            else:
                mean = torch.zeros(count)
                self._work = work = padded_buffer(self._work, count)
                for host in range(results[0].shape[0]):
                    mean += decode(pending.codec, [part[host] for part in results], count, work)
                mean /= results[0].shape[0]
        else:
            mean = torch.empty(count)
        if groups.host is not None:
            name = f"shoal.outer.host.{pending.round}.{pending.fragment}"
            mean = functions.broadcast(mean, groups.root, name=name, process_set=groups.host)
        return mean
