"""A character-level transformer language model trained on the Python standard library's own source.

Run: ``shoalrun -np 2 python examples/char_lm.py`` (or as a single process). The corpus is every ``.py`` file of
this interpreter's standard library (megabytes of real text on every machine). Each rank samples its own random
windows; DistributedOptimizer averages gradients. Rank 0 prints the loss (averaged over ranks) as it falls and a
generated sample at the end, then one JSON line: {"example": "char_lm", "world": .., "first_loss": ..,
"final_loss": ..}.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import shoal.torch as hvd


def load_corpus(limit_bytes: int) -> torch.Tensor:
    """The standard library's .py files (sorted, so every rank reads the same bytes), as a uint8 tensor."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    if not chunks:
        raise SystemExit(f"no .py files found under {stdlib}")
    return torch.frombuffer(bytearray(b"\n".join(chunks)[:limit_bytes]), dtype=torch.uint8).long()


class CharTransformer(nn.Module):
    """Byte embeddings, learned positions, a causal transformer encoder, and a byte classifier."""

    def __init__(self, context: int, width: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        return self.head(self.encoder(hidden, mask=self.mask[:length, :length], is_causal=True))


def sample(model: CharTransformer, prompt: bytes, length: int, context: int) -> str:
    """Greedy-ish sampling (temperature 0.8) from the model, continuing ``prompt``."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.tensor(list(prompt)).unsqueeze(0)
    model.eval()
    with torch.no_grad():
        for _ in range(length):
            logits = model(tokens[:, -context:])[0, -1] / 0.8
            next_token = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            tokens = torch.cat([tokens, next_token.unsqueeze(0)], 1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a char-level transformer on the Python stdlib with Shoal.")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="windows per rank per step")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    hvd.init()
    corpus = load_corpus(args.corpus_bytes)
    torch.manual_seed(0)
    model = CharTransformer(args.context)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr * math.sqrt(hvd.size())), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    generator = torch.Generator().manual_seed(1000 + hvd.rank())  # each rank reads different windows
    losses = []
    for step in range(args.steps):
        starts = torch.randint(0, len(corpus) - args.context - 1, (args.batch_size,), generator=generator)
        window = torch.stack([corpus[s : s + args.context + 1] for s in starts.tolist()])
        model.train()
        optimizer.zero_grad()
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step == 0:
            mean = hvd.allreduce(torch.tensor(sum(losses[-50:]) / len(losses[-50:])), name="loss").item()
            if hvd.rank() == 0:
                print(f"step {step + 1}/{args.steps}: loss {mean:.3f} (nats per byte)", flush=True)
            if step == 0:
                first_loss = mean
    final_loss = hvd.allreduce(torch.tensor(sum(losses[-50:]) / len(losses[-50:])), name="final.loss").item()
    if hvd.rank() == 0:
        print("sample:\n" + sample(model, b"def ", 200, args.context))
        print(
            json.dumps(
                {
                    "example": "char_lm",
                    "world": hvd.size(),
                    "first_loss": round(first_loss, 3),
                    "final_loss": round(final_loss, 3),
                }
            )
        )
    hvd.shutdown()


if __name__ == "__main__":
    main()
