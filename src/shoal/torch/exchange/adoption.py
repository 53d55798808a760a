"""Moving an optimizer's gradients into shared memory (``shared_grads``) once a session's steps show it pays.

After a session's first step, where each gradient lies is noted; after its second, the gradients move into one
shared arena (every rank together) if that step accumulated them where the first left them and nothing else
refuses (``refusal``). It is tried once per session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet, set_id_of
from shoal.core.rules import ReduceSpec
from shoal.torch import shared_grads
from shoal.torch.shared_grads import SharedGradients


def _where(grad: torch.Tensor | None) -> int:
    """Where a dense gradient's values lie (0: none, or sparse: never kept in place)."""
    return 0 if grad is None or grad.is_sparse else grad.data_ptr()


class SharedAdoption:
    """The gradients in shared memory (``shared``) of one optimizer, once adopted, and what decides the adoption."""

    __slots__ = ("_kept", "_moved", "_order", "_tried", "shared")

    def __init__(self) -> None:
        self.shared: SharedGradients | None = None
        """The gradients in shared memory, adopted after a session's second step."""
        self._tried: Any = None
        """The session in which adopting them was tried (once per session)."""
        self._order: list[torch.Tensor] = []
        """This step's parameters in the order their gradients became final (the arena's layout)."""
        self._kept: tuple[Any, dict[int, int]] | None = None
        """The session, and where each gradient was when its first step ended."""
        self._moved = False
        """A gradient was not accumulated where the previous step left it (zero_grad(set_to_none=True))."""

    def current(self) -> SharedGradients | None:
        """The gradients in shared memory, while the engine that knows their arena runs (after a re-init they are
        ordinary tensors until the next adoption)."""
        shared = self.shared
        if shared is not None and not shared.current():
            self.shared = shared = None
        return shared

    def note(self, param: torch.Tensor) -> None:
        """``param``'s gradient became final outside shared memory: note its order and whether it moved."""
        self._order.append(param)
        if self._kept is not None and _where(param.grad) != self._kept[1].get(id(param)):
            self._moved = True

    @property
    def order(self) -> list[torch.Tensor]:
        """This step's parameters outside shared memory, in the order their gradients became final."""
        return self._order

    def after_step(
        self,
        order: list[torch.Tensor],
        params: list[torch.Tensor],
        names: dict[int, str],
        spec: ReduceSpec,
        process_set: ProcessSet,
        bucket_bytes: int,
        keep_out: Callable[[torch.Tensor], bool],
        refusal: Callable[[list[torch.Tensor]], str | None],
    ) -> None:
        """A step ended (``order``: its ``order``): after a session's second step, move the eligible gradients (not
        ``keep_out``) into shared memory (every rank together), unless ``refusal(candidates)`` or a moved gradient
        says why not."""
        current = handles.current_session()
        if self.current() is not None or self._tried is current or set_id_of(process_set) != 0:
            return
        if self._kept is None or self._kept[0] is not current:  # the session's first step: watch the next one
            self._kept = (current, {id(p): _where(p.grad) for p in params})
            self._moved = False
            return
        self._tried, self._kept = current, None
        seen = {id(p) for p in order}
        ordered = [*order, *(p for p in reversed(params) if id(p) not in seen)]
        candidates = [p for p in ordered if not keep_out(p) and shared_grads.eligible(p)]
        why = self._refusal(candidates, refusal)
        self.shared = shared_grads.adopt(candidates, names, spec, process_set, bucket_bytes, why)

    def _refusal(self, candidates: list[torch.Tensor], refusal: Callable[[list[torch.Tensor]], str | None]) -> str | None:
        if not handles.engine().config.shared_gradients:
            return "switched off (shared_gradients)"
        if self._moved:
            return (
                "gradients are set to None between steps (zero_grad(set_to_none=True), torch's default), so each would be "
                "copied into shared memory, which costs more than reducing it in place saves; zero_grad(set_to_none=False) "
                "keeps them in place"
            )
        return refusal(candidates)

    def reset(self, discard: bool = False) -> None:
        """Forget this step (``discard``: it never finished)."""
        if self.shared is not None:
            self.shared.reset(discard)
        self._order = []
