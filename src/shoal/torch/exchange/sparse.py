"""Sparse gradients in the exchange: reduced by allgather (Horovod's way), or densely with ``sparse_as_dense``, and
stood in for on a rank that has none.

A rank without a gradient for a parameter that gets sparse ones stands in an empty sparse gradient, as the other
ranks allgather theirs (a dense zero would wait forever for a collective no other rank starts). Which parameters get
sparse gradients is known alike on every rank: the model's sparse embeddings, and those every rank reduced as sparse
in this session (learnt together; a re-init, as after an elastic change, starts afresh with its new members).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.core import session as handles
from shoal.core.process_sets import ProcessSet
from shoal.core.rules import ReduceOp
from shoal.torch import functions
from shoal.torch.layer_comm.schemes import gradient_request_name


def empty_sparse_like(param: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """A sparse COO gradient of ``param``'s shape with no entries (``sparse_dim`` indexed dimensions)."""
    indices = torch.empty((sparse_dim, 0), dtype=torch.long, device=param.device)
    values = torch.empty((0, *param.shape[sparse_dim:]), dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=True)


def sparse_embedding_dims(model: nn.Module) -> dict[int, int]:
    """The weights of ``model``'s embeddings made with ``sparse=True`` (sparse gradients, one indexed dimension), by
    id."""
    return {
        id(module.weight): 1
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
    }


class SparseGradients:
    """One optimizer's sparse gradients: the stand-ins, the dense detour of ``as_dense``, and this step's sparse
    reductions, started together at the step's end."""

    __slots__ = ("_densified", "_seen", "_waiting", "as_dense", "model")

    def __init__(self, model: nn.Module | None, as_dense: bool) -> None:
        self.model = model
        self.as_dense = as_dense
        """``sparse_as_dense``: reduce sparse gradients densely, and make them sparse again after."""
        self._waiting: list[torch.Tensor] = []
        self._densified: dict[int, int] = {}
        """Parameters whose sparse gradient was reduced densely, with its sparse dimensions: sparse again after the
        exchange."""
        self._seen: tuple[Any, dict[int, int]] = (None, {})
        """The session, and the parameters known in it to get sparse gradients, with their sparse dimensions."""

    def known(self) -> dict[int, int]:
        """The parameters known to get sparse gradients, on every rank alike (by id, with their sparse dimensions):
        the model's, and those reduced as sparse in this session."""
        session = handles.session()
        if self._seen[0] is not session:
            self._seen = (session, sparse_embedding_dims(self.model) if self.model is not None else {})
        return self._seen[1]

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s gradient as it is reduced: a stand-in where it has none (empty sparse where the others send
        sparse ones, else zeros), dense where ``as_dense`` says so."""
        if param.grad is None:
            sparse_dim = self.known().get(id(param))
            if sparse_dim is not None and not self.as_dense:
                param.grad = empty_sparse_like(param, sparse_dim)
            else:
                param.grad = torch.zeros_like(param)
                if sparse_dim is not None:  # sparse again after the exchange, as the other ranks' gradients
                    self._densified[id(param)] = sparse_dim
        elif param.grad.is_sparse and self.as_dense:
            self._densified[id(param)] = self.known()[id(param)] = param.grad.sparse_dim()
            param.grad = param.grad.to_dense()
        return param.grad

    def claim(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient (stood in for if missing) is sparse: then it waits here for ``reduce``."""
        if self.grad(param).is_sparse:
            self._waiting.append(param)
            return True
        return False

    def reduce(self, names: dict[int, str], op: ReduceOp, process_set: ProcessSet) -> None:
        """Reduce the waiting sparse gradients (allgather of indices and values, averaged if ``op`` is Average; each
        under its parameter's name in ``names``): each then holds the coalesced result."""
        op = ReduceOp.Average if op == ReduceOp.Average else ReduceOp.Sum  # Adasum on one rank: a sum
        # Every sparse reduction is started before any is waited for: ranks add their stand-ins last, in another
        # order than the gradients that backward produced.
        started = []
        for param in self._waiting:
            assert param.grad is not None
            name = gradient_request_name(names[id(param)])
            started.append((param, functions.sparse_allreduce_async(param.grad, name, op, process_set)))
        known = self.known()
        for param, result in started:
            param.grad = result().coalesce()
            known[id(param)] = param.grad.sparse_dim()  # every rank reduced it as sparse: all know it now

    def restore(self, params: list[torch.Tensor]) -> None:
        """As Horovod does: a gradient that was sparse is sparse again (SparseAdam refuses dense ones)."""
        for param in params:
            if id(param) in self._densified and param.grad is not None:
                param.grad = param.grad.to_sparse(self._densified[id(param)])

    def reset(self) -> None:
        """Forget this step's sparse gradients."""
        self._waiting.clear()
        self._densified.clear()
