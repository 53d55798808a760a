"""The benchmark models, built from torch.nn only (no torchvision), with synthetic inputs of fixed shape."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class _Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm and a shortcut."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetSmall(nn.Module):
    """A ResNet-like CNN for 32x32x3 images: about 2.8M parameters."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.layers = nn.Sequential(
            _Block(32, 64, 2),
            _Block(64, 64, 1),
            _Block(64, 128, 2),
            _Block(128, 128, 1),
            _Block(128, 256, 2),
            _Block(256, 256, 1),
        )
        self.head = nn.Linear(256, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


def build_mlp() -> nn.Module:
    """An MLP of about 10M parameters on flattened 32x32x3 inputs (fully connected heavy, Poseidon's case)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3072, 2048), nn.ReLU(), nn.Linear(2048, 1536), nn.ReLU(), nn.Linear(1536, 10))


class TinyTransformer(nn.Module):
    """A 4-layer transformer encoder classifier on token sequences of length 64: about 3.3M parameters."""

    def __init__(self, vocab: int = 1024, width: int = 256, layers: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def build(name: str) -> tuple[nn.Module, Callable[[int, torch.Generator], torch.Tensor]]:
    """The model and a function making a synthetic input batch of a given size."""
    if name == "cnn":
        return ResNetSmall(), lambda n, g: torch.randn(n, 3, 32, 32, generator=g)
    if name == "mlp":
        return build_mlp(), lambda n, g: torch.randn(n, 3, 32, 32, generator=g)
    if name == "transformer":
        return TinyTransformer(), lambda n, g: torch.randint(0, 1024, (n, 64), generator=g)
    raise ValueError(f"unknown model {name!r}; choose cnn, mlp or transformer")


def parameter_count(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
