"""How the model is cut: heads by KV group, layers by stage, batches into micro-batches (no processes)."""

from __future__ import annotations

import pytest

from brisk.config import ModelConfig, ParallelConfig
from brisk.parallel.pipeline import split_micro_batches, stage_layers
from brisk.parallel.tensor import (
    check_tensor_parallel,
    even_ranges,
    head_split,
    vocab_shard,
)

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3)


def test_heads_split_by_kv_group_unevenly_when_needed() -> None:
    # T=3: one KV head and its 3 query heads each
    assert [(s.q_heads, s.kv_heads) for s in (head_split(SMOLLM2, 3, r) for r in range(3))] == [
        (range(3), range(1)), (range(3, 6), range(1, 2)), (range(6, 9), range(2, 3))]
    # T=2: 9 heads do not halve, but 3 KV groups go 2 + 1 (exact: whole heads everywhere)
    assert [(s.q_heads, s.kv_heads) for s in (head_split(SMOLLM2, 2, r) for r in range(2))] == [
        (range(6), range(2)), (range(6, 9), range(2, 3))]
    # T=9: each KV head replicated on 3 ranks that take one query head each
    assert [(s.q_heads, s.kv_heads) for s in (head_split(SMOLLM2, 9, r) for r in (0, 4, 8))] == [
        (range(1), range(1)), (range(4, 5), range(1, 2)), (range(8, 9), range(2, 3))]


def test_a_size_without_an_exact_split_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 cannot split 9 attention heads in 3 KV groups.*"
                                         r"up to 3.*\(9\)"):
        check_tensor_parallel(SMOLLM2, 4)
    with pytest.raises(ValueError, match="pipeline_parallel_size 31 exceeds the model's 30 layers"):
        stage_layers(SMOLLM2, 31)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        ParallelConfig(tensor_parallel_size=0)


def test_ranges_and_vocab_shards() -> None:
    assert even_ranges(10, 3) == [range(4), range(4, 7), range(7, 10)]
    assert [vocab_shard(10, 3, r) for r in range(3)] == [range(4), range(4, 8), range(8, 12)]  # last padded


def test_stages_give_the_first_one_fewer_layers_for_the_lm_head() -> None:
    assert stage_layers(SMOLLM2, 2) == [range(11), range(11, 30)]  # the head weighs 8 layers
    assert stage_layers(SMOLLM2, 3) == [range(4), range(4, 17), range(17, 30)]
    assert stage_layers(SMOLLM2, 1) == [range(30)]
    runs = stage_layers(SMOLLM2, 30)
    assert all(len(r) == 1 for r in runs) and runs[0] == range(1)


def test_micro_batches_are_contiguous_and_balanced_by_tokens() -> None:
    assert split_micro_batches("abcd", [1, 1, 1, 1], 2) == [["a", "b"], ["c", "d"]]
    assert split_micro_batches("abcd", [500, 1, 1, 1], 2) == [["a"], ["b", "c", "d"]]
    assert split_micro_batches("ab", [1, 1], 4) == [["a"], ["b"]]
    assert split_micro_batches("a", [7], 2) == [["a"]]
    assert split_micro_batches("abc", [1, 1, 100], 2) == [["a", "b"], ["c"]]


def test_torchrun_ranks_get_every_option_rank_0_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    """cli.py builds torchrun's other ranks from the same LLM keywords as rank 0's LLM: an option
    like --dequantize, --parallel-timeout or --enforce-eager reaches every rank (they once reached only
    rank 0)."""
    from brisk.cli import build_parser
    from brisk.cli_common import engine_kwargs
    from brisk.engine.workers import WorkerArgs, torchrun_rank

    args = build_parser().parse_args(["generate", "--model", "m.gguf", "--prompt", "x", "--dequantize", "-tp", "2",
                                      "--parallel-timeout", "7", "--block-size", "32", "--no-pack-weights",
                                      "--dtype", "bfloat16", "--enforce-eager"])
    worker = WorkerArgs.of_llm(args.model, {"dtype": args.dtype, **engine_kwargs(args)})
    assert worker == WorkerArgs("m.gguf", dtype="bfloat16", tensor_parallel_size=2, timeout_s=7.0, block_size=32,
                                pack_weights=False, dequantize=True, enforce_eager=True)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert torchrun_rank() is None  # no RANK: not started by torchrun
    monkeypatch.setenv("RANK", "1")
    assert torchrun_rank() == 1
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert torchrun_rank() is None  # a single process is not a cluster
