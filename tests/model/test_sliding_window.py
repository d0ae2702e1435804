"""Sliding-window attention, exact on every path: the paged C++ kernel (each ISA level), the padded
SDPA batch, the gather + SDPA path and the contiguous backend, against a float64 reference that
masks every key outside `p - window < key <= p`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from brisk.model import paged_attention as pa
from brisk.model.attention import ContiguousAttention, SeqSpan

BS = 16


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int,
               scale: float) -> torch.Tensor:
    """q [n, heads, hd] at positions start..; keys, values [kv_len, kv_heads, hd]."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [kv_len, heads, hd]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [heads, n, kv_len]
    q_pos = torch.arange(start, start + n)[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


HEADS, KV_HEADS, NUM_BLOCKS = 4, 2, 24
SPANS = [(70, 5), (9, 1), (41, 16)]  # (kv_len, new tokens): a decode-like, a single, a chunk


class Case:
    """Three sequences over scattered blocks: their keys and values (all positions), the new
    tokens' queries, and a paged cache holding every position but the new ones."""

    def __init__(self, head_dim: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(ids)
        self.tables = [[ids.pop() for _ in range(-(-kv // BS))] for kv, _ in SPANS]
        self.keys = [torch.randn(kv, KV_HEADS, head_dim, generator=g) for kv, _ in SPANS]
        self.values = [torch.randn(kv, KV_HEADS, head_dim, generator=g) for kv, _ in SPANS]
        self.q = torch.randn(sum(n for _, n in SPANS), HEADS, head_dim, generator=g)
        self.k_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, head_dim, BS)
        self.v_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, BS, head_dim)
        for (kv, n), table, k, v in zip(SPANS, self.tables, self.keys, self.values):
            for p in range(kv - n):
                self.k_cache[table[p // BS], :, :, p % BS] = k[p]
                self.v_cache[table[p // BS], :, p % BS] = v[p]

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's keys, values [n_new, kv_heads, hd] and their (block, offset) slots."""
        ks, vs, blocks, offsets = [], [], [], []
        for (kv, n), table, k, v in zip(SPANS, self.tables, self.keys, self.values):
            ks.append(k[kv - n:])
            vs.append(v[kv - n:])
            blocks += [table[p // BS] for p in range(kv - n, kv)]
            offsets += [p % BS for p in range(kv - n, kv)]
        return torch.cat(ks), torch.cat(vs), torch.tensor(blocks), torch.tensor(offsets)

    def expected(self, window: int, scale: float) -> torch.Tensor:
        out, row = [], 0
        for (kv, n), k, v in zip(SPANS, self.keys, self.values):
            out.append(_reference(self.q[row:row + n], k, v, kv - n, window, scale))
            row += n
        return torch.cat(out)

    def metadata(self, path: str, scale: float) -> pa.PagedAttention:
        """Every span on `path`: "kernel" (the C++ kernel), "padded" (one SDPA batch), "gather"."""
        width = max(len(t) for t in self.tables)
        tables = [t + [0] * (width - len(t)) for t in self.tables]
        starts = [0]
        for _, n in SPANS:
            starts.append(starts[-1] + n)
        kv_lens = [kv for kv, _ in SPANS]
        _, _, blocks, offsets = self.new_kv()
        cpu = torch.device("cpu")
        if path == "gather":
            gather = [pa.GatherSpan(s, n, kv, [torch.tensor(t)], pa.causal_mask(n, kv, cpu))
                      for s, (kv, n), t in zip(starts, SPANS, self.tables)]
            return pa.PagedAttention([(self.k_cache, self.v_cache)], [blocks], offsets, 0,
                                     [torch.zeros(1, 1, dtype=torch.int32)], torch.zeros(1, dtype=torch.int32),
                                     torch.zeros(0, dtype=torch.int32), gather, scale)
        padded = pa.padded_spans([tables], [n for _, n in SPANS], kv_lens, BS, cpu) if path == "padded" else None
        return pa.PagedAttention([(self.k_cache, self.v_cache)], [blocks], offsets, starts[-1],
                                 [torch.tensor(tables, dtype=torch.int32)], torch.tensor(starts, dtype=torch.int32),
                                 torch.tensor(kv_lens, dtype=torch.int32), [], scale, padded=padded)


def _paged(head_dim: int, window: int, path: str, scale: float = 0.11) -> tuple[torch.Tensor, torch.Tensor]:
    case = Case(head_dim)
    k, v, _, _ = case.new_kv()
    got = case.metadata(path, scale).attend(0, case.q, k, v, window)
    return got, case.expected(window, scale)


@pytest.mark.parametrize("head_dim", [64, 256, 48])
@pytest.mark.parametrize("window", [0, 1, 7, 16, 20, 100])
@pytest.mark.parametrize("path", ["kernel", "padded", "gather"])
def test_paged_paths_attend_to_exactly_the_window(head_dim: int, window: int, path: str) -> None:
    """Windows inside one block, on a block edge, across blocks and longer than any sequence."""
    if path == "kernel" and not pa.HAVE_PAGED_KERNEL:
        pytest.skip("brisk._C not built")
    got, expected = _paged(head_dim, window, path)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_contiguous_backend_attends_to_exactly_the_window() -> None:
    case = Case(64)
    k, v, _, _ = case.new_kv()
    for window in (0, 3, 16, 30):
        caches = [(torch.zeros(len(SPANS), KV_HEADS, 80, 64), torch.zeros(len(SPANS), KV_HEADS, 80, 64))]
        spans, row = [], 0
        for slot, ((kv, n), keys, values) in enumerate(zip(SPANS, case.keys, case.values)):
            caches[0][0][slot, :, : kv - n] = keys[: kv - n].transpose(0, 1)
            caches[0][1][slot, :, : kv - n] = values[: kv - n].transpose(0, 1)
            spans.append(SeqSpan(slot, kv - n, n, row))
            row += n
        got = ContiguousAttention(caches, spans, scale=0.11).attend(0, case.q, k, v, window)
        torch.testing.assert_close(got, case.expected(window, 0.11), atol=2e-5, rtol=1e-4)


_ISA_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from test_sliding_window import _paged
from brisk import kernels
out = {{}}
for hd in (64, 256):
    got, _ = _paged(hd, 20, "kernel")
    out[hd] = got.numpy().tobytes().hex()
print(json.dumps({{"isa": kernels.CAPS.isa, "out": out}}))
"""


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_kernel_window_matches_at_every_isa_level(isa: str) -> None:
    """The portable and AVX2 builds of the kernel see the same keys (within float rounding: the
    AVX-512 path sums in another order)."""
    if not pa.HAVE_PAGED_KERNEL:
        pytest.skip("brisk._C not built")
    here = os.path.dirname(__file__)
    run = subprocess.run([sys.executable, "-c", _ISA_SCRIPT.format(tests=here)], check=True, capture_output=True,
                         text=True, env={**os.environ, "BRISK_CPU_ISA": isa})
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["isa"] == isa
    for hd in (64, 256):
        other = torch.frombuffer(bytearray.fromhex(got["out"][str(hd)]), dtype=torch.float32)
        _, expected = _paged(hd, 20, "kernel")
        torch.testing.assert_close(other.view_as(expected), expected, atol=2e-5, rtol=1e-4)
