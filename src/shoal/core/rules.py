"""Horovod's rules, written once for every front end: ops, scale factors, gradients and error kinds, as data.

``shoal.torch``, ``shoal.tensorflow`` and ``shoal.keras`` adapt types and error classes; what an op means is decided
here. A front end that needs a rule (which reduce op a call resolves to, what a gradient's factor is, which rank
counts as the root, what kind of error a failure is) asks this module instead of writing the rule again, so the
front ends cannot drift apart. The dtypes each op accepts are the engine's (``shoal.engine.validation``): what the
wire can carry is one decision for every front end too.

Sources: Horovod 0.28.1, ``horovod/common/util.py`` (``handle_average_backwards_compatibility``),
``horovod/torch/mpi_ops.py`` and ``horovod/tensorflow/mpi_ops.py`` (the registered gradients), and their tests for
the error classes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from shoal.engine.request import Kind, ReduceOp
from shoal.engine.validation import MOVABLE_DTYPES, REDUCESCATTER_OPS, REDUCING_DTYPES, dtypes_for
from shoal.exceptions import CollectiveMismatchError, HorovodInternalError, NotInitializedError, UnsupportedOperationError
from shoal.log import warn_user

__all__ = [
    "GRADIENTS",
    "MOVABLE_DTYPES",
    "REDUCESCATTER_OPS",
    "REDUCING_DTYPES",
    "Adasum",
    "Average",
    "ErrorKind",
    "GradientRule",
    "Kind",
    "Max",
    "Min",
    "Product",
    "ReduceOp",
    "ReduceSpec",
    "Select",
    "Sum",
    "check_alltoall_splits",
    "check_root_rank",
    "divides_local_gradients",
    "dtypes_for",
    "exchanges_gradients",
    "gradient_op",
    "gradient_scale",
    "is_gradient_root",
    "resolve_op",
    "split_gradients",
    "split_groups",
]

Item = TypeVar("Item")

Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.Average,
    ReduceOp.Sum,
    ReduceOp.Adasum,
    ReduceOp.Min,
    ReduceOp.Max,
    ReduceOp.Product,
)
"""Horovod's names for the reduce ops, as every front end exports them (``hvd.Sum``)."""


def resolve_op(op: int | None, average: bool | None) -> ReduceOp:
    """The reduce op of a call (Horovod's ``handle_average_backwards_compatibility``).

    ``op`` wins; the deprecated ``average`` picks Average or Sum; neither means Average.

    Raises:
        ValueError: both are given.
    """
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return ReduceOp(op)
    if average is not None:
        warn_user("Parameter `average` has been replaced with `op` and will be removed in v1.0", DeprecationWarning)
        return ReduceOp.Average if average else ReduceOp.Sum
    return ReduceOp.Average


@dataclass(frozen=True)
class ReduceSpec:
    """How a gradient exchange reduces: the op and the factors applied before and after the sum."""

    op: ReduceOp = ReduceOp.Average
    """The reduction."""
    prescale: float = 1.0
    """Multiplies every rank's input before the reduction."""
    postscale: float = 1.0
    """Multiplies the result (for Average, on top of the division by the number of ranks)."""

    @classmethod
    def for_gradients(cls, op: int, gradient_predivide_factor: float = 1.0) -> ReduceSpec:
        """Horovod's optimizers: ``gradient_predivide_factor`` f divides before the sum (``prescale = 1/f``) and
        multiplies after it (``postscale = f``), so an Average still averages; it is only valid with Average.

        Raises:
            ValueError: a predivide factor with another op.
        """
        reduce_op = ReduceOp(op)
        if gradient_predivide_factor != 1.0 and reduce_op != ReduceOp.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if reduce_op != ReduceOp.Average:
            return cls(reduce_op)
        # Divide before the sum to keep fp16 sums in range; multiply back after it.
        return cls(reduce_op, 1.0 / gradient_predivide_factor, gradient_predivide_factor)

    def aggregated(self, factor: float) -> ReduceSpec:
        """The same exchange with the result multiplied by ``factor`` (accumulated gradients)."""
        return ReduceSpec(self.op, self.prescale, self.postscale * factor)


def resolve_groups(num_groups: int, groups: Any) -> Any:
    """Horovod's ``num_groups`` and ``groups``, one rule for every front end: ``num_groups`` is deprecated (a
    ``DeprecationWarning``) and stands for ``groups`` only when ``groups`` is not given; ``groups`` wins when both are.

    Returns:
        None (no explicit groups), a group count > 0, or the list of lists of parameters/variables as given.

    Raises:
        ValueError: a negative ``num_groups``, or ``groups`` that is neither an int > 0 nor a list of lists.
    """
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
    if num_groups != 0:
        warn_user(
            "num_groups is deprecated (Horovod replaced it with groups); groups wins when both are given", DeprecationWarning
        )
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, bool) or not (
        (isinstance(groups, int) and groups > 0) or (isinstance(groups, list) and all(isinstance(g, list) for g in groups))
    ):
        raise ValueError(f"groups must be an int > 0 or a list of lists of parameters, got {groups!r}")
    return groups


def split_groups(items: list[Item], count: int) -> list[list[Item]]:
    """Horovod's ``num_groups``: ``count`` near-equal contiguous groups (the first ones one longer), empty ones
    dropped."""
    size, extra = divmod(len(items), count)
    groups, start = [], 0
    for index in range(count):
        stop = start + size + (1 if index < extra else 0)
        groups.append(items[start:stop])
        start = stop
    return [group for group in groups if group]


def split_gradients(grads: Sequence[object | None], is_local: Sequence[bool]) -> tuple[list[int], list[int]]:
    """Horovod's partial distribution: the indices of the gradients to exchange, and of those that stay on this rank
    (``register_local_source``/``register_local_var``, ``local_layers``). Missing gradients (None) are in neither."""
    pairs = list(zip(grads, is_local, strict=True))
    shared = [index for index, (grad, local) in enumerate(pairs) if grad is not None and not local]
    kept = [index for index, (grad, local) in enumerate(pairs) if grad is not None and local]
    return shared, kept


def exchanges_gradients(members: int, included: bool, elastic: bool = False) -> bool:
    """Whether this rank exchanges gradients: it belongs to the set and others do too. An elastic job always does
    (a compiled step is traced once, and the job's size may change between its runs)."""
    return included and (members > 1 or elastic)


def divides_local_gradients(scale_local_gradients: bool, exchanging: bool) -> bool:
    """Horovod's ``scale_local_gradients``: local gradients are divided by the set's size when the others are
    exchanged (averaged), so that both kinds stay on the same scale."""
    return scale_local_gradients and exchanging


def check_root_rank(root_rank: int | None, size: int) -> None:
    """A broadcast's root is a global rank of the job.

    Raises:
        ValueError: it is not (Horovod's TensorFlow: ``InvalidArgumentError``).
    """
    if root_rank is None or not 0 <= root_rank < size:
        raise ValueError(f"broadcast root_rank {root_rank} is not a rank of the job (0..{size - 1})")


def check_alltoall_splits(splits: tuple[int, ...] | None, rows: int, members: int) -> None:
    """An alltoall's splits: one non-negative count per member summing to the rows; without splits, rows that
    divide evenly.

    Raises:
        ValueError: splits of the wrong length, negative, or not summing to the first dimension; an uneven split.
    """
    if splits is not None:
        if len(splits) != members or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(
                f"alltoall splits {list(splits)} must be {members} non-negative counts summing to the first dimension {rows}"
            )
    elif rows % members != 0:
        raise ValueError(
            f"alltoall without splits needs the first dimension ({rows}) divisible by the number of ranks ({members})"
        )


# ----- gradients -----


class Select(str, enum.Enum):
    """What a rank keeps of the collective that carries a gradient backward."""

    ALL = "all"
    """The whole result."""
    OWN_ROWS = "own_rows"
    """This rank's rows of the result, offset by the rows of the set's lower ranks."""
    ROOT_ONLY = "root_only"
    """The result on the root rank; zeros on every other rank."""
    RECEIVED_SPLITS = "received_splits"
    """The result of sending the upstream gradient back along the splits the forward received."""


@dataclass(frozen=True)
class GradientRule:
    """Horovod's gradient of one collective: a collective on the upstream gradient, a factor, and a selection."""

    collective: Kind
    """The collective that carries the upstream gradient."""
    op: ReduceOp | None
    """Its reduce op when it reduces; None: the forward's own op."""
    times_size_for: frozenset[ReduceOp]
    """Forward ops for which the upstream gradient is multiplied by the process set's size."""
    times_factors: bool
    """Whether the upstream gradient is multiplied by the forward's prescale and postscale factors (for
    reducescatter; an allreduce backward passes them to its own collective instead)."""
    passes_factors: bool
    """Whether the backward collective reduces with the forward's prescale and postscale factors."""
    select: Select
    """What this rank keeps of the result."""


GRADIENTS: dict[Kind, GradientRule] = {
    # allreduce: the upstream gradient allreduced with the forward's op and factors.
    Kind.ALLREDUCE: GradientRule(Kind.ALLREDUCE, None, frozenset(), False, True, Select.ALL),
    # allgather: averaged over the ranks, then this rank's rows.
    Kind.ALLGATHER: GradientRule(Kind.ALLREDUCE, ReduceOp.Average, frozenset(), False, False, Select.OWN_ROWS),
    # broadcast: averaged over the ranks, kept on the root (a global rank, as in the forward), zero elsewhere.
    Kind.BROADCAST: GradientRule(Kind.ALLREDUCE, ReduceOp.Average, frozenset(), False, False, Select.ROOT_ONLY),
    # alltoall: sent back along the received splits.
    Kind.ALLTOALL: GradientRule(Kind.ALLTOALL, None, frozenset(), False, False, Select.RECEIVED_SPLITS),
    # reducescatter: times the set size for Sum, times the factors, then allgathered.
    Kind.REDUCESCATTER: GradientRule(Kind.ALLGATHER, None, frozenset({ReduceOp.Sum}), True, False, Select.ALL),
}
"""Horovod 0.28's registered gradients, op by op. So allgather and broadcast give the gradient of the ranks' mean
loss, allreduce that of the summed loss, and reducescatter with Sum ``size`` times the summed loss's gradient:
Horovod's conventions, kept so that a ported script trains the same."""


def gradient_op(kind: Kind, forward_op: int | None) -> ReduceOp | None:
    """The reduce op of the collective that carries ``kind``'s gradient (None when it does not reduce)."""
    rule = GRADIENTS[kind]
    if rule.collective not in (Kind.ALLREDUCE, Kind.REDUCESCATTER):
        return None
    if rule.op is not None:
        return rule.op
    return None if forward_op is None else ReduceOp(forward_op)


def gradient_scale(kind: Kind, forward_op: int | None, size: int, prescale: float = 1.0, postscale: float = 1.0) -> float:
    """The factor on ``kind``'s upstream gradient before its backward collective."""
    rule = GRADIENTS[kind]
    factor = float(size) if forward_op is not None and ReduceOp(forward_op) in rule.times_size_for else 1.0
    if rule.times_factors:
        factor *= prescale * postscale
    return factor


def backward_factors(kind: Kind, prescale: float, postscale: float) -> tuple[float, float]:
    """The prescale and postscale factors of ``kind``'s backward collective."""
    return (prescale, postscale) if GRADIENTS[kind].passes_factors else (1.0, 1.0)


def is_gradient_root(global_rank: int, root_rank: int) -> bool:
    """Whether this rank keeps a broadcast's gradient: ``root_rank`` is a global rank, in the forward and here."""
    return global_rank == root_rank


# ----- errors -----


class ErrorKind(str, enum.Enum):
    """What went wrong, neutrally; each front end maps a kind to its framework's class (as Horovod raises it)."""

    INVALID_ARGUMENT = "invalid_argument"
    """Bad input found on this rank before anything was sent (a wrong root rank, bad splits, a bad shape)."""
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    """A dtype the op cannot carry or reduce."""
    UNSUPPORTED_OPERATION = "unsupported_operation"
    """An op Horovod does not run (reducescatter with Adasum)."""
    MISMATCH = "mismatch"
    """The ranks disagree about a request (shape, dtype, op, root rank, factors): found in negotiation, on every rank."""
    NOT_INITIALIZED = "not_initialized"
    """Used before ``init()``."""
    JOB_BROKEN = "job_broken"
    """A peer died or the engine stopped (``HorovodInternalError``): elastic training restores and re-forms."""


def classify(error: BaseException) -> ErrorKind | None:
    """The neutral kind of an error a collective raised; None for errors that are not Shoal's to classify."""
    if isinstance(error, HorovodInternalError):
        return ErrorKind.JOB_BROKEN
    if isinstance(error, CollectiveMismatchError):
        return ErrorKind.MISMATCH
    if isinstance(error, UnsupportedOperationError):
        return ErrorKind.UNSUPPORTED_OPERATION
    if isinstance(error, NotInitializedError):
        return ErrorKind.NOT_INITIALIZED
    if isinstance(error, TypeError):
        return ErrorKind.UNSUPPORTED_DTYPE
    if isinstance(error, ValueError):
        return ErrorKind.INVALID_ARGUMENT
    return None
