"""The models of Horovod's published scaling table (``shoal.predict.published``) have torchvision's shapes and cost.

Parameter counts are torchvision's exactly; forward FLOPs at batch 1 are checked against the figures torchvision
publishes (in multiply-adds: 15.47 G for VGG-16, 7.80 G for ResNet-101, 5.71 G for Inception V3), which
``FlopCounterMode`` doubles because it counts a multiply-add as two FLOPs. It counts only convolutions and matrix
products, as those figures do, and the measured totals agree with them to within 0.01%.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shoal.predict.published import PUBLISHED

PARAMETERS = {"vgg16": 138_357_544, "resnet101": 44_549_160, "inception_v3": 23_834_568}
"""torchvision's counts (Inception V3 without its auxiliary classifier; 27,161,264 with it)."""

FORWARD_FLOPS = {"vgg16": 2 * 15.47e9, "resnet101": 2 * 7.80e9, "inception_v3": 2 * 5.71e9}
"""Forward FLOPs per image: twice the published multiply-add counts."""

SHAPES: dict[str, dict[str, tuple[int, ...]]] = {
    "vgg16": {"features.28.weight": (512, 512, 3, 3), "classifier.0.weight": (4096, 25088)},
    "resnet101": {"layer3.22.conv2.weight": (256, 256, 3, 3), "layer4.0.downsample.0.weight": (2048, 1024, 1, 1)},
    "inception_v3": {
        "Mixed_6e.branch7x7dbl_5.conv.weight": (192, 192, 1, 7),
        "Mixed_7c.branch3x3dbl_2.conv.weight": (384, 448, 3, 3),
        "fc.weight": (1000, 2048),
    },
}
"""A few parameters by their torchvision names, with torchvision's shapes."""


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Keep the forward passes on one core; restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameters_match_torchvision(name: str) -> None:
    model, _ = PUBLISHED[name]()
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]
    shapes = {key: tuple(p.shape) for key, p in model.named_parameters()}
    for key, shape in SHAPES[name].items():
        assert shapes[key] == shape, key


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_forward_shape_and_flops(name: str) -> None:
    model, make_input = PUBLISHED[name]()
    model.eval()
    x = make_input(1, torch.Generator().manual_seed(0))
    size = 299 if name == "inception_v3" else 224
    assert x.shape == (1, 3, size, size)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        y = model(x)
    assert y.shape == (1, 1000)
    assert torch.isfinite(y).all()
    assert counter.get_total_flops() == pytest.approx(FORWARD_FLOPS[name], rel=0.03)
