"""Paged attention through the runner equals the contiguous reference, for mixed batches over
scattered blocks: kernel path, gather path, both dtypes."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from brisk.config import ModelConfig
from brisk.model import paged_attention
from brisk.model.attention import ContiguousAttention, SeqSpan
from brisk.model.llama import LlamaForCausalLM
from brisk.runtime.model_runner import allocate_contiguous_kv
from brisk.runtime.paged_runner import PagedModelRunner

CFG = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)


@dataclass
class Step:
    request_id: str
    token_ids: list[int]
    start_pos: int
    table: list[int]
    sample: bool = True
    all_ids: list[int] = field(default_factory=list)

    @property
    def block_ids(self) -> list[list[int]]:
        return [self.table]  # the one KV group of a model without sliding layers


def _model(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    m = LlamaForCausalLM(CFG, max_positions=512)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m.to(dtype).eval()


def _reference(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    caches = allocate_contiguous_kv(CFG, 1, len(ids), model.dtype, "cpu")
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(caches, [SeqSpan(0, 0, len(ids), 0)]))
        return model.compute_logits(h[-1:])[0]


@pytest.mark.parametrize("short_spans", ["kernel", "padded", "gather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mixed_batches_over_scattered_blocks_match_reference(short_spans: str, dtype: torch.dtype) -> None:
    if short_spans == "kernel" and not paged_attention.HAVE_PAGED_KERNEL:
        pytest.skip("brisk._C not built")
    _check_against_reference(dtype, short_spans, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_paged_runner_on_cuda_matches_cpu_reference(dtype: torch.dtype) -> None:
    _check_against_reference(dtype, "padded", "cuda")


def _check_against_reference(dtype: torch.dtype, short_spans: str, device: str) -> None:
    model = _model(dtype)
    bs, num_blocks = 4, 64
    runner = PagedModelRunner(model.to(device), num_blocks=num_blocks, block_size=bs)
    runner.short_spans = short_spans
    model = _model(dtype)  # the CPU copy computes the reference
    rng = random.Random(0)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, out-of-order block ids
    lengths = {"a": 37, "b": 5, "c": 20, "d": 1}
    seqs = {k: [rng.randrange(CFG.vocab_size) for _ in range(n)] for k, n in lengths.items()}
    tables = {k: [free.pop() for _ in range(-(-(n + 8) // bs))] for k, n in lengths.items()}
    done = {k: 0 for k in seqs}
    # steps mixing a long chunk, short chunks and single tokens until every prompt is consumed
    plan = [{"a": 20, "b": 2, "c": 3, "d": 1}, {"a": 17, "b": 3, "c": 17}]
    tol = (2e-4 if device == "cpu" else 2e-3) if dtype == torch.float32 else 0.15
    for chunk_sizes in plan:
        steps = [Step(k, seqs[k][done[k]:done[k] + n], done[k], tables[k], done[k] + n == lengths[k])
                 for k, n in chunk_sizes.items()]
        out = runner.execute(steps, frozenset({"c"}))  # every row of c, as verification asks
        logits, order = out.last_rows(out.sample_ids), out.sample_ids
        for k, n in chunk_sizes.items():
            done[k] += n
        for row, rid in enumerate(order):
            ref = _reference(model, seqs[rid][: done[rid]])
            assert (logits[row].cpu() - ref).abs().max() < tol * max(1.0, float(ref.abs().max()))
        every = out.of("c")  # row j: the logits after the chunk's first j + 1 tokens
        assert every.shape[0] == chunk_sizes["c"]
        for j in range(every.shape[0]):
            ref = _reference(model, seqs["c"][: done["c"] - chunk_sizes["c"] + j + 1])
            assert (every[j].cpu() - ref).abs().max() < tol * max(1.0, float(ref.abs().max()))
    # then decode steps: every sequence grows by one token per step
    for _ in range(6):
        steps = []
        for k in seqs:
            tok = rng.randrange(CFG.vocab_size)
            seqs[k].append(tok)
            steps.append(Step(k, [tok], len(seqs[k]) - 1, tables[k]))
        out = runner.execute(steps)
        logits, order = out.last_rows(out.sample_ids), out.sample_ids
        for row, rid in enumerate(order):
            ref = _reference(model, seqs[rid])
            assert (logits[row].cpu() - ref).abs().max() < tol * max(1.0, float(ref.abs().max()))


def test_steps_without_sampling_return_no_rows() -> None:
    runner = PagedModelRunner(_model(torch.float32), num_blocks=8, block_size=4)
    out = runner.execute([Step("x", [1, 2, 3], 0, [5, 6], sample=False)])
    assert out.logits.shape == (0, CFG.vocab_size) and out.sample_ids == [] and out.rows == {}


@pytest.mark.skipif(not paged_attention.HAVE_PAGED_KERNEL, reason="brisk._C not built")
def test_a_verify_step_gives_each_row_exactly_its_single_token_logits() -> None:
    """Speculative verification scores t_last and up to 7 drafts in one step: every row's logits
    must equal bit for bit what decoding those tokens one at a time gives (greedy stays exact)."""
    from brisk import kernels

    if kernels.SMALL_GEMM_MAX_ROWS < 8:
        pytest.skip("the batch-invariant small GEMM needs AVX-512")
    model = _model(torch.float32)
    prompt = list(range(3, 40))
    tail = [7, 19, 3, 55, 21, 8, 90, 4]  # t_last and 7 "drafts"
    one = PagedModelRunner(model, num_blocks=16, block_size=16)
    one.execute([Step("a", prompt, 0, [0, 1, 2, 3])])
    singles = []
    for i, tok in enumerate(tail):
        out = one.execute([Step("a", [tok], len(prompt) + i, [0, 1, 2, 3])])
        singles.append(out.last_rows(["a"])[0])
    many = PagedModelRunner(model, num_blocks=16, block_size=16)
    many.execute([Step("a", prompt, 0, [4, 5, 6, 7])])
    rows = many.execute([Step("a", tail, len(prompt), [4, 5, 6, 7])], frozenset({"a"})).of("a")
    for i in range(len(tail)):
        assert torch.equal(rows[i], singles[i]), f"row {i} differs from single-token decoding"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_zeros_are_zeros_of_the_dtype_from_lazily_zeroed_pages(dtype: torch.dtype) -> None:
    """A CPU KV cache comes from calloc'd pages (no load-time memset): zeros all the same."""
    from brisk.runtime.paged_runner import kv_zeros

    t = kv_zeros((3, 2, 5, 4), dtype, torch.device("cpu"))
    assert t.dtype == dtype and t.shape == (3, 2, 5, 4) and t.is_contiguous() and not t.any()
    t[1, 1] = 2.0  # writable, and a write touches only its own elements
    assert t.sum().item() == 2.0 * 20
