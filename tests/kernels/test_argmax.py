"""kernels.argmax_rows is torch.argmax(x, -1): the first maximum of every row, NaN ranked highest,
for rows of any length (vector body and tail), ties inside one vector lane group and across."""

from __future__ import annotations

import pytest
import torch

from brisk import kernels


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 262144 + 3])
def test_random_rows_equal_torch(vocab: int) -> None:
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))


def test_ties_take_the_first_index_like_torch() -> None:
    x = torch.zeros(6, 100)
    x[0, [3, 19, 35]] = 7.0  # the same lane of three vectors
    x[1, [21, 5]] = 7.0  # different lanes, the later lane first in memory
    x[2, [97, 98]] = 7.0  # the tail
    x[3, [15, 99]] = 7.0  # a vector and the tail
    x[4] = float("-inf")  # nothing beats -inf: index 0
    x[5, [40, 60]] = float("inf")
    assert kernels.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [3, 5, 97, 15, 0, 40]


def test_nan_rows_follow_torch() -> None:
    x = torch.randn(3, 70)
    x[0, 50] = float("nan")
    x[2, 69] = float("nan")
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))


def test_other_tensors_take_torch() -> None:
    x = torch.randn(4, 33, dtype=torch.bfloat16)
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    y = torch.randn(33, 4).t()  # not contiguous
    assert torch.equal(kernels.argmax_rows(y), y.argmax(dim=-1))


@pytest.mark.parametrize(("vocab", "words"), [(49152, 1536), (70, 3), (70, 2), (1, 1)])
def test_token_bitmask_kernel_matches_torch_unpacking(vocab: int, words: int) -> None:
    """The grammar-mask kernel against the torch unpacking it replaces: whole forbidden words,
    whole allowed ones, mixed ones, a vocabulary that is not a multiple of 32, and tokens past the
    mask's last word (forbidden)."""
    from brisk.kernels import CAPS, apply_token_bitmask

    if not CAPS.has("apply_token_bitmask_"):
        pytest.skip("this build has no apply_token_bitmask_ kernel")
    gen = torch.Generator().manual_seed(vocab + words)
    kinds = torch.randint(0, 3, (5, words), generator=gen)
    mixed = torch.randint(-2**31, 2**31 - 1, (5, words), generator=gen, dtype=torch.int64)
    bitmask = torch.where(kinds == 0, 0, torch.where(kinds == 1, -1, mixed)).to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().reshape(5, -1)
    allowed = torch.zeros(5, vocab, dtype=torch.bool)
    allowed[:, :min(vocab, bits.shape[1])] = bits[:, :vocab]
    before = logits.clone()
    got = apply_token_bitmask(logits, bitmask)
    assert got is not None and torch.equal(got, logits.masked_fill(~allowed, float("-inf")))
    assert torch.equal(logits, before)  # a copy was masked, the input kept
