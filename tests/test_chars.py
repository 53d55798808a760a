"""shoal.bench.chars: the stdlib byte corpus splits by file and reproducibly, batches are next-byte windows, and a
tiny CharModel is causal and learns."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.bench.chars import (
    UNIFORM_LOSS,
    VOCAB_SIZE,
    CharModel,
    batch,
    corpus_files,
    eval_windows,
    evaluate,
    load_corpus,
    loss,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    return load_corpus(max_bytes=800_000)


def test_split_is_by_file_and_disjoint() -> None:
    train, held_out = corpus_files()
    assert len(train) > 100 and len(held_out) > 10
    assert not set(train) & set(held_out)
    assert 0.03 < len(held_out) / (len(train) + len(held_out)) < 0.2  # about one file in ten
    assert (train, held_out) == corpus_files()
    for path in train + held_out:
        assert path.suffix == ".py"
        assert not {"site-packages", "test", "tests", "idlelib", "lib2to3"} & set(path.parts)
    held_out_texts = {path.read_bytes() for path in held_out if path.stat().st_size > 200}
    assert not held_out_texts & {path.read_bytes() for path in train}


def test_two_loads_are_identical_and_capped(corpus: tuple[torch.Tensor, torch.Tensor]) -> None:
    train, held_out = corpus
    again_train, again_held_out = load_corpus(max_bytes=800_000)
    assert train.dtype == held_out.dtype == torch.uint8
    assert train.shape == (800_000,) and held_out.shape == (100_000,)
    assert torch.equal(train, again_train) and torch.equal(held_out, again_held_out)
    train_files, held_out_files = corpus_files()
    assert bytes(train[:1000].tolist()) == b"".join(path.read_bytes() for path in train_files[:20])[:1000]
    assert bytes(held_out[:1000].tolist()) == b"".join(path.read_bytes() for path in held_out_files[:20])[:1000]


def test_batch_gives_next_byte_targets_and_repeats_with_its_seed(corpus: tuple[torch.Tensor, torch.Tensor]) -> None:
    train, _ = corpus
    x, y = batch(train, 8, 32, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    text = train.numpy().tobytes()
    for row in range(8):
        start = text.find(bytes(x[row].tolist()))
        assert start >= 0, "a batch row is not a window of the stream"
        assert text[start + 1 : start + 33] == bytes(y[row].tolist())
    counting = torch.arange(5000)  # every window of a counting stream is a run, so y must be x + 1 exactly
    x_counting, y_counting = batch(counting, 64, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x_counting[:, 1:] - x_counting[:, :-1], torch.ones(64, 15, dtype=torch.int64))
    assert torch.equal(y_counting, x_counting + 1) and int(y_counting.max()) <= 4999
    again_x, again_y = batch(train, 8, 32, torch.Generator().manual_seed(3))
    assert torch.equal(x, again_x) and torch.equal(y, again_y)
    other_x, _ = batch(train, 8, 32, torch.Generator().manual_seed(4))
    assert not torch.equal(x, other_x)


def test_eval_windows_are_fixed_spread_and_non_overlapping(corpus: tuple[torch.Tensor, torch.Tensor]) -> None:
    _, held_out = corpus
    x, y = eval_windows(held_out, 16, 10)
    assert x.shape == y.shape == (10, 16)
    stride = held_out.numel() // 10
    for row in range(10):
        assert torch.equal(x[row], held_out[row * stride : row * stride + 16].long())
        assert torch.equal(y[row], held_out[row * stride + 1 : row * stride + 17].long())
    again_x, _ = eval_windows(held_out, 16, 10)
    assert torch.equal(x, again_x)
    with pytest.raises(ValueError, match="do not fit"):
        eval_windows(held_out[:100], 16, 10)


def test_model_output_shape_and_starting_loss() -> None:
    torch.manual_seed(0)
    model = CharModel()
    assert sum(parameter.numel() for parameter in model.parameters()) == 470_784
    x = torch.randint(0, VOCAB_SIZE, (3, 64))
    assert model(x).shape == (3, 64, VOCAB_SIZE)
    assert model(x[:, :10]).shape == (3, 10, VOCAB_SIZE)
    assert abs(loss(model, x, x).item() - UNIFORM_LOSS) < 0.2
    with pytest.raises(ValueError, match="longer than the context"):
        model(torch.zeros(1, 65, dtype=torch.int64))


def test_later_bytes_do_not_change_earlier_logits() -> None:
    torch.manual_seed(1)
    model = CharModel(d_model=32, layers=2, heads=2, context=16).eval()
    x = torch.randint(0, VOCAB_SIZE, (2, 16))
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB_SIZE
    with torch.no_grad():
        before, after = model(x), model(changed)
    assert torch.allclose(before[:, :10], after[:, :10], atol=1e-6)
    assert not torch.allclose(before[:, 10:], after[:, 10:], atol=1e-4)


def test_a_few_adam_steps_lower_the_held_out_loss(corpus: tuple[torch.Tensor, torch.Tensor]) -> None:
    train, held_out = corpus
    torch.manual_seed(0)
    model = CharModel(d_model=32, layers=1, heads=4, context=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    eval_x, eval_y = eval_windows(held_out, 16, 128)
    start = evaluate(model, eval_x, eval_y)
    assert model.training
    assert abs(start - math.log(256)) < 0.2
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        x, y = batch(train, 16, 16, generator)
        optimizer.zero_grad()
        loss(model, x, y).backward()
        optimizer.step()
    end = evaluate(model, eval_x, eval_y)
    assert end < start - 1.0, (start, end)  # about 5.55 to 3.1 on Python 3.11
