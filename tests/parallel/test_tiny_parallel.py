"""Spawned workers on a tiny model: T x P grids give one process's tokens, quantized shards run,
and a killed or hung worker ends generation with a clear error within seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.parallel.groups import ParallelFailure

PROMPTS = ["w3 w5 w9", "w10 w11", "w7 w7 w7 w2 w40 w33 w12 w13 w14 w15 w16 w17 w18 w19 w20", "w1"]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
ENGINE = {"num_kv_blocks": 64, "block_size": 4, "max_num_batched_tokens": 16}


def _tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> list[list[int]]:
    return _tokens(LLM(str(tiny_dir), **ENGINE))


@pytest.mark.parametrize(("tp", "pp"), [(2, 2), (4, 1)])
def test_grid_gives_the_tokens_of_one_process(tiny_dir: Path, reference: list[list[int]], tp: int, pp: int) -> None:
    """2 x 2: four processes, QKV bias and an untied head sharded, two stages, every step cut into
    two micro-batches (a 15-token prompt in chunks of 16 tokens per step beside decodes, some
    micro-batches with no row to sample); 4 x 1: more ranks than KV heads, each KV head
    replicated on two ranks."""
    threads = torch.get_num_threads()
    micro = 2 if pp > 1 else None
    with LLM(str(tiny_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_micro_batches=micro,
             **ENGINE) as llm:
        assert _tokens(llm) == reference
        ranks = llm._cluster.runner.comm_stats()  # type: ignore[union-attr]
        assert len(ranks) == tp * pp and all(r["all_reduce_bytes"] > 0 for r in ranks)
        # the first stage (with the LM head) gathers the logits' vocabulary shards; under pipeline
        # parallelism every rank sends activations: forward to the next stage, or the last stage's
        # final hidden rows back to the first
        assert [r["gather_bytes"] > 0 for r in ranks] == [r < tp for r in range(tp * pp)]
        assert all((r["p2p_bytes"] > 0) == (pp > 1) for r in ranks)
    assert torch.get_num_threads() == threads  # rank 0 gave its share of the cores back


def test_sliding_window_kv_groups_over_a_grid(tiny_gemma_dir: Path) -> None:
    """Gemma 3's layers in 4 KV groups (their blocks let go outside the window) split over two
    stages of two tensor-parallel ranks: one process's tokens."""
    single = _tokens(LLM(str(tiny_gemma_dir), **ENGINE))
    with LLM(str(tiny_gemma_dir), tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE) as llm:
        assert len(llm.engine.runner.groups) == 4
        assert _tokens(llm) == single


def test_quantized_shards(tiny_dir: Path) -> None:
    """int8 quantizes each rank's shard: the row-parallel down projection keeps half the columns."""
    from brisk.quant.int8 import Int8Linear

    single = LLM(str(tiny_dir), quantization="int8", **ENGINE)
    with LLM(str(tiny_dir), quantization="int8", tensor_parallel_size=2, **ENGINE) as llm:
        down = llm.model.layers[0].mlp.down_proj.inner
        assert isinstance(down, Int8Linear) and down.in_features == 24
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
        a = single.generate(PROMPTS, params, use_tqdm=False)
        b = llm.generate(PROMPTS, params, use_tqdm=False)
        # scales per output channel over 24 columns instead of 48: close, not equal
        for x, y in zip(a, b):
            (lx,), (ly,) = x.outputs[0].logprobs, y.outputs[0].logprobs
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            assert abs(lx.logprob - ly.logprob) < 0.1


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_worker_ends_generation_with_a_clear_error(tiny_dir: Path, how: str) -> None:
    llm = LLM(str(tiny_dir), tensor_parallel_size=2, pipeline_parallel_size=2, parallel_timeout_s=2.0, **ENGINE)
    try:
        llm.engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        llm.engine.add_request("b", [6, 7], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        for _ in range(3):
            llm.engine.step()
        victim = llm._cluster.workers.procs[3]  # type: ignore[union-attr]
        os.kill(victim.pid, getattr(signal, how))
        started = time.monotonic()
        with pytest.raises(ParallelFailure) as err:
            for _ in range(200):
                llm.engine.step()
        elapsed = time.monotonic() - started
        if how == "SIGKILL":
            assert f"worker rank 3 (pid {victim.pid}) was killed by SIGKILL" in str(err.value), str(err.value)
            assert elapsed < 10
        else:
            assert f"worker rank 3 (pid {victim.pid}) is stopped (SIGSTOP or a debugger) and did not answer " \
                   "within 2 s" in str(err.value)
            assert elapsed < 15, str(err.value)
        # nothing left behind: requests ended, blocks returned, every worker process gone
        assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.kv_usage == 0
        codes = [p.poll() for p in llm._cluster.workers.procs.values()]  # type: ignore[union-attr]
        assert None not in codes, codes
        with pytest.raises(ParallelFailure, match="parallel engine stopped"):
            llm.generate("w1 w2", GREEDY, use_tqdm=False)
    finally:
        llm.close()


def test_ngram_speculation_over_a_grid_is_lossless(tiny_dir: Path, reference: list[list[int]]) -> None:
    """Verify rows go through the same sharded layers (each rank's small GEMM sums every row as it
    sums it alone, the all-reduce adds in rank order): the drafts change nothing."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(str(tiny_dir), tensor_parallel_size=2, pipeline_parallel_size=2, speculative_config=spec,
             **ENGINE) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_the_engine_keeps_its_workers_and_one_grid_runs_per_process(tiny_dir: Path,
                                                                     reference: list[list[int]]) -> None:
    llm = LLM(str(tiny_dir), tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    with pytest.raises(ValueError, match="already runs a parallel engine"):
        LLM(str(tiny_dir), tensor_parallel_size=2, **ENGINE)
    del llm  # a server may keep only the engine: the workers stay
    engine.add_request("a", [3, 5, 9], GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    assert tokens == reference[0]
    del engine
    import gc

    gc.collect()
    import torch.distributed as dist

    assert not dist.is_initialized()  # collected with the engine: workers stopped, group gone


def test_bad_parallel_options_fail_before_spawning(tiny_dir: Path, tmp_path: Path) -> None:
    from brisk.config import QuantConfig
    from brisk.loader.convert import quantize_to_dir

    with pytest.raises(ValueError, match="cannot split 4 attention heads in 2 KV groups"):
        LLM(str(tiny_dir), tensor_parallel_size=3)
    saved = quantize_to_dir(str(tiny_dir), QuantConfig("int8"), tmp_path / "q8")
    with pytest.raises(ValueError, match=r"is a quantized checkpoint \(int8\); tensor parallelism slices float"):
        LLM(str(saved), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="-q int4 needs input widths divisible by 32"):
        LLM(str(tiny_dir), tensor_parallel_size=2, quantization="int4",
            quantization_config={"group_size": 32, "calibration": "none"})
    with pytest.raises(ValueError, match="calibrated quantization .* runs on the whole model.*calibration.*none"):
        LLM(str(tiny_dir), tensor_parallel_size=2, quantization="w8a8")  # calibrated on its own text by default
    with pytest.raises(ValueError, match="speculative method 'medusa' runs in a single process"):
        LLM(str(tiny_dir), tensor_parallel_size=2, speculative_config={"method": "medusa", "heads": "h.safetensors"})


def test_a_failed_join_leaves_the_process_able_to_start_a_grid(tiny_dir: Path, reference: list[list[int]]) -> None:
    """A worker that never joins (its rank 0 gives up) or that dies before joining is reported at
    once, and this process can start a grid afterwards (torch names its next group from a counter
    that a failed join left bumped: fresh workers would wait on a name rank 0 no longer uses)."""
    import torch.distributed as dist

    from brisk.config import ParallelConfig
    from brisk.parallel.groups import init_distributed, local_store, wait_for_workers

    store = local_store(0, 2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="a worker process ended before it joined"):
        wait_for_workers(store, 2, alive=lambda: False)
    with pytest.raises(RuntimeError):  # nobody joins: gloo gives up after the step timeout
        init_distributed(ParallelConfig(tensor_parallel_size=2, timeout_s=1.0), 0, "cpu", store)
    assert time.monotonic() - started < 30 and not dist.is_initialized()
    with LLM(str(tiny_dir), tensor_parallel_size=2, parallel_timeout_s=30.0, **ENGINE) as llm:
        assert _tokens(llm) == reference


def test_torchrun_runs_the_same_command_on_every_rank(tiny_dir: Path) -> None:
    """The multi-node launch, on one node: torchrun starts 2 ranks of `brisk generate`; rank 0
    prints, rank 1 serves steps; the text is one process's."""
    args = ["generate", "--model", str(tiny_dir), "--prompt", "w3 w5 w9", "--temperature", "0", "--max-tokens",
            "12", "--num-kv-blocks", "64", "--block-size", "4"]
    single = subprocess.run([sys.executable, "-m", "brisk.cli", *args], capture_output=True, text=True, timeout=120, check=False)
    assert single.returncode == 0, single.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "brisk.cli", *args, "--tensor-parallel-size", "2"],
                         capture_output=True, text=True, timeout=180, env=env, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == single.stdout and single.stdout.strip()


def test_the_server_reports_a_dead_worker_and_stops(tiny_dir: Path) -> None:
    import httpx

    from tests.server.conftest import running_server

    llm = LLM(str(tiny_dir), tensor_parallel_size=2, **ENGINE)
    try:
        with running_server(llm) as (base, _):
            body = {"prompt": "w3 w4", "max_tokens": 4, "temperature": 0}
            assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
            victim = llm._cluster.workers.procs[1]  # type: ignore[union-attr]
            os.kill(victim.pid, signal.SIGKILL)
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 503
            assert f"worker rank 1 (pid {victim.pid}) was killed by SIGKILL" in reply.json()["error"]["message"]
            assert httpx.get(f"{base}/health", timeout=10).status_code == 503
    finally:
        llm.close()


def test_an_idle_server_notices_a_dead_worker(tiny_dir: Path) -> None:
    import httpx

    from tests.server.conftest import running_server

    llm = LLM(str(tiny_dir), tensor_parallel_size=2, **ENGINE)
    try:
        with running_server(llm) as (base, _):
            assert httpx.get(f"{base}/health", timeout=10).status_code == 200
            os.kill(llm._cluster.workers.procs[1].pid, signal.SIGKILL)  # type: ignore[union-attr]
            deadline = time.monotonic() + 10
            while httpx.get(f"{base}/health", timeout=10).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert httpx.get(f"{base}/health", timeout=10).status_code == 503  # no request needed
    finally:
        llm.close()


def test_kv_blocks_fit_the_fullest_rank(tiny_dir: Path) -> None:
    """kv_cache_memory_gib is per process: with 2 stages the stage with more layers sets the block
    count (here both hold 2 of 4 layers: twice the blocks of one process holding all 4)."""
    from brisk.runtime.paged_runner import kv_block_bytes

    gib = 2**20 / 2**30  # 1 MiB
    single = LLM(str(tiny_dir), kv_cache_memory_gib=gib, block_size=4)
    with LLM(str(tiny_dir), kv_cache_memory_gib=gib, block_size=4, pipeline_parallel_size=2) as llm:
        assert kv_block_bytes(llm.model, 4) * 2 == kv_block_bytes(single.model, 4)
        assert llm.engine.num_blocks == 2 * single.engine.num_blocks


def test_pruned_layers_of_different_widths_split_over_ranks(tiny_dir: Path, tmp_path: Path) -> None:
    """A structurally pruned model (per-layer KV heads and MLP widths, o_proj / down_proj biases
    that rank 0 alone adds) over two tensor-parallel ranks: one process's tokens."""
    from brisk.compress.prune import prune_to_dir
    from brisk.config import PruneConfig
    from brisk.loader.hf_loader import hf_model_config

    calibration = tmp_path / "calibration.txt"
    calibration.write_text(" ".join(f"w{(i * 7 + i // 5) % 64}" for i in range(600)))
    out = tmp_path / "pruned"
    prune_to_dir(str(tiny_dir), PruneConfig("structured", 0.3, str(calibration), calibration_tokens=512, multiple=16), out)
    cfg = hf_model_config(out)
    assert not cfg.uniform and cfg.output_bias
    assert len(set(cfg.layer_kv_heads)) > 1 or len(set(cfg.layer_intermediate)) > 1
    single = _tokens(LLM(str(out), **ENGINE))
    with LLM(str(out), tensor_parallel_size=2, **ENGINE) as llm:
        assert _tokens(llm) == single
