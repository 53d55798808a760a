"""What both gradient exchanges share: the parameters and their names, a hook each, and the count of backward
passes."""

from __future__ import annotations

from typing import Any

import torch

from shoal.torch.optimizer_class import computed_too_often


class BackwardHooks:
    """The parameters and their names, a post-accumulate-grad hook each, and the count of backward passes: a
    parameter whose gradient has had all ``passes`` reaches ``_ready``."""

    __slots__ = ("_counts", "_hooks", "advice", "names", "params", "passes")

    def __init__(self, params: list[torch.Tensor], names: dict[int, str], passes: int, advice: str) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.params = params
        self.names = names
        self.passes = passes
        self.advice = advice
        """What the error for a gradient computed too often suggests."""
        self._counts: dict[int, int] = dict.fromkeys(map(id, params), 0)
        self._hooks: list[Any] = []

    def attach(self) -> None:
        """Register the hooks: from now on every final gradient reaches ``on_grad``."""
        self._hooks = [p.register_post_accumulate_grad_hook(self.on_grad) for p in self.params]

    def detach(self) -> None:
        """Remove the hooks: the gradients stay local."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def on_grad(self, param: torch.Tensor) -> None:
        """A gradient was accumulated: once it has all ``passes`` backward passes, start exchanging it."""
        self._before_count(param)
        key = id(param)
        if self._started(key):
            raise computed_too_often(self.names[key], self.passes, self.advice)
        self._counts[key] += 1
        if self._counts[key] == self.passes:
            self._counts[key] = 0
            self._ready(param)

    def reset(self) -> None:
        """Forget this step's passes."""
        self._counts = dict.fromkeys(self._counts, 0)

    def _before_count(self, param: torch.Tensor) -> None:
        """Called first for every gradient."""

    def _started(self, key: int) -> bool:
        raise NotImplementedError

    def _ready(self, param: torch.Tensor) -> None:
        raise NotImplementedError
