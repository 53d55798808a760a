"""VGG-16, ResNet-101 and Inception V3 as plain ``torch.nn``, layer for layer as torchvision builds them.

Horovod's paper and README publish one scaling table: 128 servers with 4 Pascal GPUs each (512 GPUs), joined by
25 Gbit/s RoCE, reach 90% scaling efficiency on Inception V3 and ResNet-101 and 68% on VGG-16. To reproduce the
shape of that table with ``python -m shoal.predict`` one needs the three models' parameter shapes (what each step
reduces) and FLOPs per layer (what each step computes), and nothing else: weights are never loaded, the models are
built with random initialisation. torchvision is not a dependency of shoal, so the three are written out here.

Every parameter has the shape torchvision gives it, and every module the name torchvision gives it (``features.28``,
``layer3.22.conv2``, ``Mixed_6e.branch7x7dbl_5.conv``), so a per-layer report reads like one about torchvision's
models and a torchvision ``state_dict`` would load. Parameter counts: 138,357,544 (VGG-16), 44,549,160 (ResNet-101)
and 23,834,568 (Inception V3 without its auxiliary classifier, 3,326,696 parameters more, which only adds a side loss
during training).

Each factory returns ``(model, make_input)`` as ``shoal.predict.profile.load_model`` expects, so
``shoal.predict.published:resnet101`` names a model on the command line; ``PUBLISHED`` maps the three names to them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from shoal.predict.profile import MakeInput

NUM_CLASSES = 1000
"""ImageNet's classes: the width of every model's last layer."""


def _images(size: int) -> MakeInput:
    """A ``make_input`` that draws a batch of normally distributed ``3 × size × size`` images."""

    def make_input(batch: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(batch, 3, size, size, generator=generator)

    return make_input


# --- VGG-16 ------------------------------------------------------------------------------------------------------

VGG16_LAYERS: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
"""VGG configuration D: a number is a 3×3 convolution (padding 1) with that many output channels, then a ReLU;
``"M"`` is a 2×2 max pool of stride 2."""


class VGG(nn.Module):
    """VGG without batch norm: ``features`` (convolutions and pools), ``avgpool`` to 7×7, then ``classifier``."""

    def __init__(self, layers: Sequence[int | str] = VGG16_LAYERS, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        modules: list[nn.Module] = []
        channels = 3
        for layer in layers:
            if layer == "M":
                modules.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                width = int(layer)
                modules += [nn.Conv2d(channels, width, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                channels = width
        self.features = nn.Sequential(*modules)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(channels * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        out: torch.Tensor = self.classifier(torch.flatten(x, 1))
        return out


def vgg16() -> tuple[nn.Module, MakeInput]:
    """torchvision's ``vgg16`` (configuration D, no batch norm) on 224×224 images: 138,357,544 parameters,
    about 15.5 G multiply-adds a forward pass per image, 90% of the parameters in the first fully connected layer."""
    return VGG(), _images(224)


# --- ResNet-101 --------------------------------------------------------------------------------------------------


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (carrying the block's stride, as in ResNet v1.5), 1×1 expand by ``expansion``; each
    convolution without bias and followed by batch norm, the sum with the shortcut followed by a ReLU."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        out: torch.Tensor = self.relu(y + shortcut)
        return out


class ResNet(nn.Module):
    """A bottleneck ResNet: a 7×7 stem of stride 2 and a 3×3 max pool, four stages (``layer1`` to ``layer4``) of
    64, 128, 256 and 512 planes, the last three starting with stride 2, then global average pooling and ``fc``."""

    def __init__(self, blocks: Sequence[int], num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._stage(64, blocks[0], stride=1)
        self.layer2 = self._stage(128, blocks[1], stride=2)
        self.layer3 = self._stage(256, blocks[2], stride=2)
        self.layer4 = self._stage(512, blocks[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _stage(self, planes: int, count: int, stride: int) -> nn.Sequential:
        """``count`` blocks; the first changes width (and resolution, for stride 2) and so needs a projection
        shortcut, a 1×1 convolution without bias and a batch norm, named ``downsample`` as in torchvision."""
        out = planes * Bottleneck.expansion
        downsample: nn.Module | None = None
        if stride != 1 or self.inplanes != out:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, out, kernel_size=1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )
        blocks = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = out
        blocks += [Bottleneck(out, planes) for _ in range(1, count)]
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        out: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return out


def resnet101() -> tuple[nn.Module, MakeInput]:
    """torchvision's ``resnet101`` (bottleneck blocks 3, 4, 23, 3; v1.5) on 224×224 images: 44,549,160 parameters,
    about 7.8 G multiply-adds a forward pass per image."""
    return ResNet([3, 4, 23, 3]), _images(224)


# --- Inception V3 ------------------------------------------------------------------------------------------------

_Size = int | tuple[int, int]


class BasicConv2d(nn.Module):
    """Inception's unit: a convolution without bias, batch norm with eps 0.001, ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: _Size, stride: int = 1, padding: _Size = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.relu(self.bn(self.conv(x)))
        return out


def _chain(x: torch.Tensor, *convs: nn.Module) -> torch.Tensor:
    """``x`` through ``convs`` in turn."""
    for conv in convs:
        x = conv(x)
    return x


def _avg_pool_same(x: torch.Tensor) -> torch.Tensor:
    """The 3×3, stride 1, padding 1 average pool in front of the pool branches of blocks A, C and E."""
    return nn.functional.avg_pool2d(x, kernel_size=3, stride=1, padding=1)


class InceptionA(nn.Module):
    """35×35 block (``Mixed_5b``–``Mixed_5d``): 1×1; 1×1 then 5×5; 1×1 then two 3×3; pool then 1×1.
    Output ``224 + pool_features`` channels."""

    def __init__(self, in_channels: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(in_channels, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(in_channels, pool_features, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                self.branch1x1(x),
                _chain(x, self.branch5x5_1, self.branch5x5_2),
                _chain(x, self.branch3x3dbl_1, self.branch3x3dbl_2, self.branch3x3dbl_3),
                self.branch_pool(_avg_pool_same(x)),
            ],
            1,
        )


class InceptionB(nn.Module):
    """Reduction 35×35 → 17×17 (``Mixed_6a``): 3×3 of stride 2; 1×1, 3×3, 3×3 of stride 2; 3×3 max pool of
    stride 2. Output ``480 + in_channels`` channels."""

    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(in_channels, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                self.branch3x3(x),
                _chain(x, self.branch3x3dbl_1, self.branch3x3dbl_2, self.branch3x3dbl_3),
                nn.functional.max_pool2d(x, kernel_size=3, stride=2),
            ],
            1,
        )


class InceptionC(nn.Module):
    """17×17 block (``Mixed_6b``–``Mixed_6e``) with factorised 7×7 convolutions (1×7 and 7×1) of ``channels_7x7``
    channels: 1×1; 1×1, 1×7, 7×1; 1×1, 7×1, 1×7, 7×1, 1×7; pool then 1×1. Output 768 channels."""

    def __init__(self, in_channels: int, channels_7x7: int) -> None:
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(in_channels, 192, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                self.branch1x1(x),
                _chain(x, self.branch7x7_1, self.branch7x7_2, self.branch7x7_3),
                _chain(
                    x,
                    self.branch7x7dbl_1,
                    self.branch7x7dbl_2,
                    self.branch7x7dbl_3,
                    self.branch7x7dbl_4,
                    self.branch7x7dbl_5,
                ),
                self.branch_pool(_avg_pool_same(x)),
            ],
            1,
        )


class InceptionD(nn.Module):
    """Reduction 17×17 → 8×8 (``Mixed_7a``): 1×1, 3×3 of stride 2; 1×1, 1×7, 7×1, 3×3 of stride 2; 3×3 max pool
    of stride 2. Output ``512 + in_channels`` channels."""

    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch3x3_1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                _chain(x, self.branch3x3_1, self.branch3x3_2),
                _chain(x, self.branch7x7x3_1, self.branch7x7x3_2, self.branch7x7x3_3, self.branch7x7x3_4),
                nn.functional.max_pool2d(x, kernel_size=3, stride=2),
            ],
            1,
        )


class InceptionE(nn.Module):
    """8×8 block (``Mixed_7b``, ``Mixed_7c``) with expanded filter banks: 1×1 (320); 1×1 (384) then 1×3 and 3×1
    side by side; 1×1 (448), 3×3 (384), then 1×3 and 3×1 side by side; pool then 1×1 (192). Output 2048 channels."""

    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(in_channels, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(in_channels, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(in_channels, 192, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y3 = self.branch3x3_1(x)
        ydbl = _chain(x, self.branch3x3dbl_1, self.branch3x3dbl_2)
        return torch.cat(
            [
                self.branch1x1(x),
                self.branch3x3_2a(y3),
                self.branch3x3_2b(y3),
                self.branch3x3dbl_3a(ydbl),
                self.branch3x3dbl_3b(ydbl),
                self.branch_pool(_avg_pool_same(x)),
            ],
            1,
        )


class Inception3(nn.Module):
    """Inception V3 on 299×299 images as torchvision builds it with ``aux_logits=False, transform_input=False``:
    the stem ``Conv2d_1a_3x3``–``Conv2d_4a_3x3`` with two max pools, blocks ``Mixed_5b``–``Mixed_7c``, global average
    pooling, dropout and ``fc``."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.maxpool1 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.maxpool2 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, channels_7x7=128)
        self.Mixed_6c = InceptionC(768, channels_7x7=160)
        self.Mixed_6d = InceptionC(768, channels_7x7=160)
        self.Mixed_6e = InceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280)
        self.Mixed_7c = InceptionE(2048)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=0.5)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _chain(x, self.Conv2d_1a_3x3, self.Conv2d_2a_3x3, self.Conv2d_2b_3x3, self.maxpool1)
        x = _chain(x, self.Conv2d_3b_1x1, self.Conv2d_4a_3x3, self.maxpool2)
        x = _chain(x, self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a)
        x = _chain(x, self.Mixed_6b, self.Mixed_6c, self.Mixed_6d, self.Mixed_6e)
        x = _chain(x, self.Mixed_7a, self.Mixed_7b, self.Mixed_7c, self.avgpool, self.dropout)
        out: torch.Tensor = self.fc(torch.flatten(x, 1))
        return out


def inception_v3() -> tuple[nn.Module, MakeInput]:
    """torchvision's ``inception_v3`` without the auxiliary classifier on 299×299 images: 23,834,568 parameters,
    about 5.7 G multiply-adds a forward pass per image."""
    return Inception3(), _images(299)


PUBLISHED: dict[str, Callable[[], tuple[nn.Module, MakeInput]]] = {
    "vgg16": vgg16,
    "resnet101": resnet101,
    "inception_v3": inception_v3,
}
"""The models of Horovod's published scaling table, by torchvision's names."""
