"""What one rank's memory holds under each ``shard=`` option, predicted from the model's size and its optimizer:
the first half of planning memory with the network (ZeRO's stages, arXiv 1910.02054, as Shoal runs them).

The parts, per rank of N (P: the parameters' bytes; S: the optimizer state's, k per parameter element):

| part | none | ``optimizer`` (stage 1) | ``gradients`` (stage 2) |
|---|---|---|---|
| parameters | P | P | P |
| gradients | P | P | P/N in the shards |
| optimizer state | S | S/N | S/N |
| the shards' copy of the rank's values | 0 | P/N | P/N |

``held`` is their sum: what a rank keeps between steps. ``peak`` adds the largest transient of a step and the
activations when they are given. The transients: the optimizer's temporaries while it steps
(``step_temporaries`` copies of what it steps: torch's foreach Adam makes about one); stage 1's copy of the
gradients into the shards; the gradients' one move into shared memory where several ranks share a host (unsharded
and stage 1); stage 2's gradients in flight during backward (the two largest buckets, and their blocks).

Measured against ``shoal.bench.shard --only`` on one host (docs/sharding.md): within 5% where the model's state
outweighs what the process holds for itself, not yet where it does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OPTIONS = ("none", "optimizer", "gradients")
"""The ``shard=`` options, from the least sharded."""


@dataclass(frozen=True)
class ModelMemory:
    """What the prediction needs to know of a model and its optimizer."""

    param_bytes: int
    """The trainable parameters' bytes."""
    state_per_element: float
    """Optimizer state elements per parameter element (Adam: 2, SGD with momentum: 1, plain SGD: 0)."""
    step_temporaries: float = 1.0
    """The optimizer's temporaries while it steps, in copies of what it steps."""
    activation_bytes: int = 0
    """What a forward and backward pass holds beyond the model's state (measured; 0 when unknown)."""
    in_flight_bytes: int = 0
    """Stage 2's backward: the gradients of the two largest buckets, one being produced while the other is reduced
    (wait-free backprop keeps both alive)."""
    adopts_shared: bool = False
    """Several ranks share a host: unsharded and at stage 1 the gradients move into shared memory after the first
    steps, a copy of them held for a moment."""

    def __post_init__(self) -> None:
        figures = (self.param_bytes, self.state_per_element, self.step_temporaries, self.activation_bytes, self.in_flight_bytes)
        if min(figures) < 0:
            raise ValueError(f"memory figures cannot be negative: {self}")


@dataclass(frozen=True)
class MemoryEstimate:
    """One option's prediction for one rank."""

    option: str
    parts: dict[str, int] = field(default_factory=dict)
    """What the rank holds between steps, by part."""
    transient: int = 0
    """The largest extra a step adds."""

    @property
    def held(self) -> int:
        """Bytes held between steps."""
        return sum(self.parts.values())

    @property
    def peak(self) -> int:
        """Bytes at the step's peak."""
        return self.held + self.transient


def bucket_members(nbytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """The sharded optimizer's buckets over parameters of ``nbytes`` given in the order backward finishes them: the
    indices each bucket holds. A bucket closes once it holds ``bucket_bytes``; a parameter of ``bucket_bytes`` or
    more gets a bucket of its own (its gradient then leaves without a copy)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    held = 0
    for index, size in enumerate(nbytes):
        if size >= bucket_bytes and current:
            buckets.append(current)
            current, held = [], 0
        current.append(index)
        held += size
        if held >= bucket_bytes:
            buckets.append(current)
            current, held = [], 0
    if current:
        buckets.append(current)
    return buckets


def in_flight(nbytes: list[int], bucket_bytes: int) -> int:
    """Stage 2's gradients in flight during backward: the two largest buckets' bytes (``bucket_members``)."""
    sizes = sorted((sum(nbytes[i] for i in bucket) for bucket in bucket_members(nbytes, bucket_bytes)), reverse=True)
    return sum(sizes[:2])


def estimate(model: ModelMemory, ranks: int, option: str) -> MemoryEstimate:
    """One rank's memory under ``option`` (``OPTIONS``) with ``ranks`` ranks sharing the state.

    Raises:
        ValueError: an unknown option, or fewer than one rank.
    """
    if option not in OPTIONS:
        raise ValueError(f"unknown shard option {option!r}; choose from {OPTIONS}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    params = model.param_bytes
    state = round(model.state_per_element * params)
    own = -(-params // ranks)  # this rank's share, rounded up
    stepped = params if option == "none" else own
    temporaries = round(model.step_temporaries * stepped)
    adoption = params if model.adopts_shared else 0  # the gradients' one move into shared memory
    if option == "none":
        parts = {"parameters": params, "gradients": params, "optimizer state": state}
        transient = max(temporaries, adoption)
    elif option == "optimizer":
        parts = {"parameters": params, "gradients": params, "optimizer state": -(-state // ranks), "shards": own}
        transient = own + max(temporaries, adoption)  # the gradients' copy into the shards, for the step
    else:
        parts = {"parameters": params, "gradients": own, "optimizer state": -(-state // ranks), "shards": own}
        in_flight = model.in_flight_bytes + -(-model.in_flight_bytes // ranks)  # and what their reduce-scatters return
        transient = max(temporaries, in_flight)
    return MemoryEstimate(option, parts, transient + model.activation_bytes)


def estimates(model: ModelMemory, ranks: int) -> list[MemoryEstimate]:
    """Every option's prediction, from the least sharded."""
    return [estimate(model, ranks, option) for option in OPTIONS]
