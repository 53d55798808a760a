"""A small, real character-level language-modelling task that needs no download: bytes of Python's own stdlib.

The corpus is the ``*.py`` source of the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``):
the files directly in that directory and in its packages, leaving out ``site-packages`` and the ``test``, ``tests``,
``idlelib`` and ``lib2to3`` directories (huge, repetitive test code and tools rather than library code). The split
into training and held-out text is by file, so that no held-out file was seen in training: a file is held out when
the CRC-32 of its path relative to the stdlib directory is 0 mod 10 (about a tenth of the files). The vocabulary is
the 256 byte values, so there is nothing to build and every machine with the same Python version reads the same
corpus; another Python version has another stdlib and hence another corpus.

``load_corpus`` gives the two byte streams, ``batch`` draws random training windows with a caller-seeded generator
(one per rank), ``eval_windows`` cuts a fixed held-out set, and ``CharModel`` is a small decoder-only transformer
over bytes with ``loss`` and ``evaluate`` to train and score it. The caller owns the training loop.
"""

from __future__ import annotations

import math
import os
import sysconfig
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256
"""One token per byte value."""

UNIFORM_LOSS = math.log(VOCAB_SIZE)
"""The cross-entropy of a uniform guess over bytes, ln 256 ≈ 5.545 nats: an untrained model's loss."""

DEFAULT_MAX_BYTES = 8_000_000
"""The default cap on the training stream; the held-out stream is capped at an eighth of it."""

HELD_OUT_EVERY = 10
"""A file is held out when the CRC-32 of its relative path is 0 modulo this (about one file in ten)."""

_SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out(relative: str) -> bool:
    # crc32 of the POSIX-style relative path, not hash(): str hashes are salted per process.
    return zlib.crc32(relative.encode("utf-8")) % HELD_OUT_EVERY == 0


def corpus_files() -> tuple[list[Path], list[Path]]:
    """List the stdlib source files of the corpus, split by file.

    The search takes ``*.py`` files in the stdlib directory and descends only into packages (directories with an
    ``__init__.py``), which leaves out ``site-packages``, ``lib-dynload`` and the build's ``config-*`` directory;
    the test and tool directories named in the module docstring are skipped as well.

    Returns:
        ``(train, held_out)``: absolute paths, each list sorted by path relative to the stdlib directory.
    """
    root = _stdlib_root()
    train: list[Path] = []
    held_out: list[Path] = []
    for directory, subdirectories, names in os.walk(root):
        here = Path(directory)
        # Pruning in place keeps os.walk out of site-packages and the test suite (most of the tree's size).
        subdirectories[:] = sorted(
            name for name in subdirectories if name not in _SKIPPED_DIRECTORIES and (here / name / "__init__.py").is_file()
        )
        for name in sorted(names):
            if name.endswith(".py"):
                path = here / name
                (held_out if _is_held_out(path.relative_to(root).as_posix()) else train).append(path)
    train.sort(key=lambda path: path.relative_to(root).as_posix())
    held_out.sort(key=lambda path: path.relative_to(root).as_posix())
    return train, held_out


def _read_capped(paths: list[Path], limit: int) -> torch.Tensor:
    """The files' bytes concatenated in order, cut at ``limit`` bytes, as a 1-D uint8 tensor."""
    data = bytearray()
    for path in paths:
        if len(data) >= limit:
            break
        data += path.read_bytes()
    del data[limit:]
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the training and held-out byte streams of the stdlib corpus.

    Each stream is its files' bytes concatenated in ``corpus_files`` order (a window may span two files), cut at
    its cap. Two calls on one machine, or on machines with the same Python version, give equal tensors.

    Args:
        max_bytes: the cap on the training stream; the held-out stream is capped at ``max_bytes // 8``.

    Returns:
        ``(train, held_out)``: 1-D ``torch.uint8`` tensors of byte values.

    Raises:
        ValueError: when ``max_bytes`` is less than 8.
    """
    if max_bytes < 8:
        raise ValueError(f"load_corpus: max_bytes must be at least 8, not {max_bytes}")
    train_files, held_out_files = corpus_files()
    return _read_capped(train_files, max_bytes), _read_capped(held_out_files, max_bytes // 8)


def _check_stream(stream: torch.Tensor, context: int, what: str) -> None:
    if stream.dim() != 1:
        raise ValueError(f"{what}: the stream must be 1-D, not of shape {tuple(stream.shape)}")
    if context < 1:
        raise ValueError(f"{what}: context must be at least 1, not {context}")
    if stream.numel() < context + 1:
        raise ValueError(f"{what}: a stream of {stream.numel()} bytes is shorter than one window of {context + 1}")


def _windows(stream: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``stream[s : s + context]`` and targets ``stream[s + 1 : s + context + 1]`` for each start ``s``."""
    offsets = torch.arange(context + 1, device=stream.device)
    chunks = stream[starts.to(stream.device).unsqueeze(1) + offsets].long()
    return chunks[:, :-1], chunks[:, 1:]


def batch(stream: torch.Tensor, batch_size: int, context: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch_size`` windows at uniformly random offsets of a byte stream.

    Args:
        stream: a 1-D byte stream from ``load_corpus``.
        batch_size: how many windows.
        context: the length of each window.
        generator: draws the offsets; seed it per rank so each rank draws its own reproducible batches.

    Returns:
        ``(x, y)``: int64 tensors of shape ``(batch_size, context)`` on the stream's device, where ``y`` is the
        byte after each byte of ``x`` in the stream.
    """
    _check_stream(stream, context, "batch")
    starts = torch.randint(0, stream.numel() - context, (batch_size,), generator=generator, device=generator.device)
    return _windows(stream, starts, context)


def eval_windows(stream: torch.Tensor, context: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a fixed evaluation set: ``count`` non-overlapping windows spread evenly over a stream.

    Window ``i`` starts at ``i * (len(stream) // count)``; no window's targets reach into the next window.

    Args:
        stream: a 1-D byte stream, normally the held-out one.
        context: the length of each window.
        count: how many windows.

    Returns:
        ``(x, y)``: int64 tensors of shape ``(count, context)``, laid out as ``batch`` lays them out.

    Raises:
        ValueError: when ``count`` windows of ``context + 1`` bytes do not fit in the stream.
    """
    _check_stream(stream, context, "eval_windows")
    if count < 1:
        raise ValueError(f"eval_windows: count must be at least 1, not {count}")
    stride = stream.numel() // count
    if stride < context + 1:
        raise ValueError(
            f"eval_windows: {count} windows of {context + 1} bytes do not fit in a stream of {stream.numel()} bytes"
        )
    return _windows(stream, torch.arange(count) * stride, context)


class _Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP, each on a residual path."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.projection = nn.Linear(d_model, d_model)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch_size, length, width = hidden.shape
        query, key, value = self.qkv(self.attention_norm(hidden)).split(width, dim=2)
        shape = (batch_size, length, self.heads, width // self.heads)
        attended = F.scaled_dot_product_attention(
            query.view(shape).transpose(1, 2),
            key.view(shape).transpose(1, 2),
            value.view(shape).transpose(1, 2),
            is_causal=True,
        )
        hidden = hidden + self.projection(attended.transpose(1, 2).reshape(batch_size, length, width))
        return hidden + self.mlp(self.mlp_norm(hidden))


class CharModel(nn.Module):
    """A small decoder-only transformer over bytes: about 0.47M parameters with the defaults.

    Byte and learned position embeddings, ``layers`` pre-LayerNorm blocks of causal self-attention and a 4x GELU
    MLP, a final LayerNorm and a head to 256 logits. Weights start as GPT-2's do (normal, std 0.02; zero biases),
    so the untrained loss is close to ln 256 ≈ 5.55, the loss of a uniform guess. The caller seeds the
    construction (``torch.manual_seed``) so every rank builds the same weights.

    Args:
        d_model: the width of the embeddings and of every block.
        layers: how many transformer blocks.
        heads: attention heads per block; must divide ``d_model``.
        context: the longest input sequence (the size of the position embedding).
    """

    def __init__(self, d_model: int = 128, layers: int = 2, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        if d_model % heads != 0:
            raise ValueError(f"CharModel: heads ({heads}) must divide d_model ({d_model})")
        self.context = context
        self.byte_embedding = nn.Embedding(VOCAB_SIZE, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE)
        self.apply(self._initialise)

    @staticmethod
    def _initialise(module: nn.Module) -> None:
        # GPT-2's initialisation (Radford et al. 2019, as in nanoGPT): PyTorch's defaults give logits of std ~0.6 and a
        # starting loss above ln 256.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Score the next byte at every position.

        Args:
            x: int64 byte values of shape ``(batch, length)`` with ``length <= context``.

        Returns:
            Logits of shape ``(batch, length, 256)``; position ``t`` depends only on ``x[:, : t + 1]``.
        """
        length = x.shape[1]
        if length > self.context:
            raise ValueError(f"CharModel: a sequence of {length} is longer than the context of {self.context}")
        hidden = self.byte_embedding(x) + self.position_embedding(torch.arange(length, device=x.device))
        for block in self.blocks:
            hidden = block(hidden)
        logits: torch.Tensor = self.head(self.final_norm(hidden))
        return logits


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean next-byte cross-entropy, in nats, over every position of a batch.

    Args:
        model: a ``CharModel`` (or any module mapping ``(B, T)`` bytes to ``(B, T, 256)`` logits).
        x: input bytes of shape ``(B, T)``, on the model's device.
        y: target bytes of the same shape.

    Returns:
        A scalar tensor that backpropagates into the model.
    """
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The held-out loss of a model: ``loss`` in eval mode and without gradients.

    The model is put back in the mode it was in (training, in a training loop) before returning.

    Args:
        model: the model to score.
        x: input bytes, e.g. from ``eval_windows``, on the model's device.
        y: target bytes of the same shape.

    Returns:
        The mean cross-entropy in nats; ``UNIFORM_LOSS`` is a uniform guess's.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return float(loss(model, x, y).item())
    finally:
        model.train(was_training)
