"""A torch model as the planner sees it: one ``ModelLayer`` per module that owns trainable parameters.

``shoal.plan`` is framework-neutral (it imports no torch); this module walks an ``nn.Module`` once and hands the
planner plain descriptions: bytes, parameter shapes, the (K, M, N) of a fully-connected layer that ran forward, and
whether its weight is tied to another module's.
"""

from __future__ import annotations

from torch import nn

from shoal.plan.calibration import Calibration
from shoal.plan.costs import LayerShape, LossyOptions
from shoal.plan.planner import LayerPlan, ModelLayer, plan_layers
from shoal.plan.schemes import AUTO_SCHEMES, Scheme


def spares_local_gradient(module: nn.Module) -> bool:
    """Whether SFB on ``module`` spares backward its local weight gradient: an ``nn.Linear`` with a trainable bias
    (what ``shoal.torch.layer_comm.sfb`` needs to leave the weight out of autograd's graph)."""
    bias = getattr(module, "bias", None)
    return isinstance(module, nn.Linear) and bias is not None and bias.requires_grad


def tied_modules(model: nn.Module) -> set[str]:
    """The names of the modules that hold a parameter directly which another module also holds (tied weights, e.g.
    an embedding and the output layer of a language model)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    return {
        name
        for name, module in model.named_modules()
        if any(holders[id(param)] > 1 for param in module.parameters(recurse=False))
    }


def model_layers(model: nn.Module, rows: dict[str, int]) -> list[ModelLayer]:
    """Every module of ``model`` that owns trainable parameters directly, in ``named_modules`` order.

    Args:
        model: the model.
        rows: K for each ``nn.Linear`` by module name (the maximum over ranks); a linear layer without K (it did not
            run forward) or with a tied weight gets no (K, M, N), so SFB cannot serve it.
    """
    tied = tied_modules(model)
    layers = []
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        linear = None
        if isinstance(module, nn.Linear) and name in rows and name not in tied:
            linear = (rows[name], module.out_features, module.in_features)
        shape = LayerShape(
            sum(p.numel() * p.element_size() for p in params),
            tuple(tuple(p.shape) for p in params),
            params[0].element_size(),
            linear,
            spares_local_gradient(module),
        )
        weight = getattr(module, "weight", None)
        layers.append(
            ModelLayer(
                name=name,
                kind=type(module).__name__,
                weight_shape=tuple(weight.shape) if weight is not None else (),
                shape=shape,
                rows=rows.get(name),
                tied=name in tied,
                handle=module,
            )
        )
    return layers


def build_plan(
    model: nn.Module,
    calibration: Calibration,
    workers: int,
    rows: dict[str, int],
    overrides: dict[object, object] | None = None,
    allowed: tuple[Scheme, ...] = AUTO_SCHEMES,
    servers: int | None = None,
    lossy: LossyOptions | None = None,
) -> list[LayerPlan]:
    """Plan every module of ``model`` that owns trainable parameters (``shoal.plan.planner.plan_layers`` over
    ``model_layers(model, rows)``); ``overrides`` may name a module or a module type, e.g. ``{"fc1": "sfb",
    nn.Embedding: "allreduce"}``."""
    return plan_layers(model_layers(model, rows), calibration, workers, overrides, allowed, servers, lossy)
