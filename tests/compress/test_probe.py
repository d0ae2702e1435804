"""Probe Pruning on the default model: ratio 0 is the dense model; the decision pass computes
what the compact model it decides computes; a batch's generation runs on that compact model
through the decode plan, batched as alone; the batch's probe decides (a request alone and in a
batch may get different channels, by design); bad input is refused before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.compress.probe import (
    ProbePruner,
    check_probe,
    keep_counts,
    layer_ratio,
    probe_rows,
)
from brisk.config import PruneConfig
from brisk.loader.load import LoadedModel, load_model
from brisk.model.attention import SeqSpan
from brisk.model.base import forward_sequence

CALIBRATION = str(Path(__file__).resolve().parents[2] / "README.md")
TOKENS = 512
PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time, in a small village,", "1, 2, 3, 4,"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _pcfg(ratio: float, **kw: object) -> PruneConfig:
    return PruneConfig("probe", ratio, CALIBRATION, calibration_tokens=TOKENS, **kw)  # type: ignore[arg-type]


def _options(ratio: float) -> dict[str, object]:
    return {"method": "probe", "ratio": ratio, "calibration": CALIBRATION, "calibration_tokens": TOKENS}


@pytest.fixture(scope="module")
def dense(gguf_path: Path) -> LoadedModel:
    return load_model(str(gguf_path), dequantize=True)


@pytest.fixture(scope="module")
def pruner(dense: LoadedModel) -> ProbePruner:
    return ProbePruner.from_loaded(dense, _pcfg(0.4))


@pytest.fixture(scope="module")
def probe_llm(gguf_path: Path) -> LLM:
    return LLM(str(gguf_path), pruning=_options(0.4))


def _ids(dense: LoadedModel, text: str) -> list[int]:
    return dense.tokenizer.encode(text)


def test_ratio_zero_generates_the_dense_models_tokens(gguf_path: Path, brisk_llm: LLM) -> None:
    dense = brisk_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    probed = LLM(str(gguf_path), pruning=_options(0.0)).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in probed] == [o.outputs[0].token_ids for o in dense]


def test_layer_shares_add_up_to_the_ratio(dense: LoadedModel, pruner: ProbePruner) -> None:
    cfg = dense.config
    assert pruner.rho == pytest.approx(0.4 * cfg.num_hidden_layers / (cfg.num_hidden_layers - 3))
    assert all(k == (cfg.kv_heads(i), cfg.intermediate(i)) for i, k in enumerate(pruner.keep[:3]))  # dense layers
    groups, width = keep_counts(cfg, 5, pruner.rho, 64)
    assert groups < cfg.kv_heads(5) and width % 64 == 0 and width < cfg.intermediate(5)
    assert abs(pruner.report()["layer_weights_removed"] - 0.4) < 0.03  # whole groups and 64-wide steps


def test_probe_rows_pick_the_strongest_sequence_and_tokens() -> None:
    scale = torch.tensor([1.0, 1.1, 1.2, 1.3, 9.0, 2.0, 4.0, 5.0, 3.0, 6.0])  # sequence 1 (rows 5..9) is
    stream = torch.ones(10, 4) * scale[:, None]  # louder on average, sequence 0 has the loudest token
    spans = [SeqSpan(0, 0, 5, 0), SeqSpan(1, 0, 5, 5)]
    rows = probe_rows(stream, spans, 0.05, 0.5)
    assert rows.tolist() == [6, 7, 9]  # one sequence (5% of 2, at least one), ceil(half) of its tokens
    assert probe_rows(stream, spans, 1.0, 0.2).tolist() == [4, 9]


def test_decision_pass_computes_what_the_compact_model_computes(dense: LoadedModel, pruner: ProbePruner) -> None:
    ids = _ids(dense, "The quick brown fox jumps over the lazy dog, and then it runs into the forest.")
    hidden, decision = pruner.forward([ids])
    plan = decision.plan
    assert sorted(plan.kv_groups) == list(range(3, dense.config.num_hidden_layers))
    compact = pruner.compact_model(plan)
    assert compact.config.layer_kv_heads[5] == pruner.keep[5][0]
    assert compact.config.layer_intermediate[5] == pruner.keep[5][1]
    with torch.inference_mode():
        torch.testing.assert_close(compact.compute_logits(forward_sequence(compact, ids)),
                                   dense.model.compute_logits(hidden), atol=2e-4, rtol=1e-4)
        full = dense.model.compute_logits(forward_sequence(dense.model, ids))
    assert not torch.allclose(full, dense.model.compute_logits(hidden), atol=1e-2)  # it did prune
    shared = compact.layers[0].mlp.down_proj.weight  # untouched tensors are the dense model's, not copies
    assert shared.data_ptr() == dense.model.layers[0].mlp.down_proj.weight.data_ptr()
    assert pruner.decide([ids]).plan == plan  # deterministic
    # Another batch's decision refills the idle compact model in place: as a fresh one computes.
    other = pruner.decide([_ids(dense, "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)")]).plan
    assert other != plan
    with torch.inference_mode():
        fresh = pruner.compact_model(other)
        refilled = pruner.compact_model(other, reuse=compact)
        assert refilled is compact
        torch.testing.assert_close(refilled.compute_logits(forward_sequence(refilled, ids)),
                                   fresh.compute_logits(forward_sequence(fresh, ids)), atol=0, rtol=0)


def test_the_batch_decides_by_its_probe_sequence(dense: LoadedModel, pruner: ProbePruner) -> None:
    """5% of a 4-prompt batch is one sequence, the one with the largest residual norm entering
    the first pruned layer: the batch's decision is that prompt's alone, so the other prompts get
    channels other than their own (a request's output depends on its batch: README, Pruning).
    The same batch always decides the same."""
    seqs = [_ids(dense, p) for p in PROMPTS]
    batch = pruner.decide(seqs).plan
    alone = [pruner.decide([s]).plan for s in seqs]
    loudest = int(pruner._entry_norms(seqs).argmax())
    assert alone[loudest] == batch
    assert any(a != batch for a in alone)
    assert pruner.decide(seqs).plan == batch
    assert pruner.decide([seqs[loudest], seqs[loudest]]).plan == batch


def test_generation_runs_the_compact_model_batched_as_alone(probe_llm: LLM) -> None:
    llm = probe_llm
    batched = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    decision, compact = llm.last_probe, llm.model
    assert decision is not None and compact is not llm._dense_model
    assert decision.probe_rows > 0 and decision.seconds > 0
    assert all(o.metrics.ttft > decision.seconds for o in batched)  # the decision counts in TTFT
    # Each request's tokens are the compact model's greedy choices over its own sequence (the
    # paged, batched decode plan equals a whole-sequence forward of the same model)...
    for prompt, out in zip(PROMPTS, batched):
        ids = llm.tokenizer.encode(prompt)
        new = out.outputs[0].token_ids
        with torch.inference_mode():
            logits = compact.compute_logits(forward_sequence(compact, ids + new[:-1]))
        assert logits[len(ids) - 1:].argmax(-1).tolist() == new
    # A request alone is its own batch: its own decision, the same check on its own model.
    alone = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.last_probe is not decision and llm.model is compact  # same widths: the model is refilled
    ids = llm.tokenizer.encode(PROMPTS[1])
    with torch.inference_mode():
        logits = llm.model.compute_logits(forward_sequence(llm.model, ids + alone[:-1]))
    assert logits[len(ids) - 1:].argmax(-1).tolist() == alone


def test_an_open_batch_blocks_a_new_decision(probe_llm: LLM) -> None:
    llm = probe_llm
    stream = llm.stream("Hello there", GREEDY)
    next(stream)
    with pytest.raises(ValueError, match="per batch of prompts, and requests of an earlier batch are still running"):
        llm.generate("Another prompt", GREEDY, use_tqdm=False)
    stream.close()
    assert llm.generate("Another prompt", GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # the KV came back
    # n samples of one prompt: the batch's KV is sized for every sibling
    many = llm.generate("Once", SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=7, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [len(c.token_ids) for c in many.outputs] == [40, 40, 40]


@pytest.mark.parametrize(("options", "message"), [
    ({"ratio": 1.0}, "from 0 .the dense model. up to but not including 1"),
    ({"ratio": -0.1}, "from 0"),
    ({"probe_tokens": 0}, "probe_tokens is a share of the batch"),
    ({"probe_sequences": 1.5}, "probe_sequences is a share"),
    ({"dense_layers": -1}, "dense_layers .first layers left whole. must be an integer"),
])
def test_bad_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PruneConfig.parse({**_options(0.4), **options})


def test_what_a_model_cannot_take_is_refused_before_loading(gguf_path: Path, dense: LoadedModel) -> None:
    cfg = dense.config
    with pytest.raises(ValueError, match="leaves none of the 30 layers to prune"):
        check_probe(cfg, _pcfg(0.2, dense_layers=30))
    with pytest.raises(ValueError, match="removes 1.00 of each"):
        check_probe(cfg, _pcfg(0.9, dense_layers=3))
    assert layer_ratio(cfg, _pcfg(0.0)) == 0
    with pytest.raises(ValueError, match="cannot combine with quantization"):
        LLM(str(gguf_path), pruning=_options(0.4), quantization="int8")
    with pytest.raises(ValueError, match="single process"):
        LLM(str(gguf_path), pruning=_options(0.4), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="calibration text .* is not a file"):
        LLM(str(gguf_path), pruning={**_options(0.4), "calibration": "/nonexistent.txt"})


def test_the_server_refuses_per_batch_pruning(probe_llm: LLM) -> None:
    from brisk.server import build_app

    with pytest.raises(ValueError, match="serve a statically pruned model instead"):
        build_app(probe_llm)


# ~20 s (two engines, calibration, a batched workload): a slow check, run with the benchmarks.
@pytest.mark.slow
def test_bench_prune_measures_probe_variants_with_their_decisions() -> None:
    from brisk.bench.prune_bench import bench_prune

    engine = {"max_model_len": 512, "num_kv_blocks": 64, "dequantize": True}
    res = bench_prune(["smollm2-135m", "probe:0.3"], engine, new_tokens=4, repeats=1, batch=2,
                      calibration=CALIBRATION)
    dense, probe = res["models"]
    assert dense["pruning"] is None and probe["pruning"] == "probe 0.3"
    assert probe["params_m"] < dense["params_m"] and probe["weight_mib"] < dense["weight_mib"]
    assert probe["decode_tok_s"] > 0 and probe["batched_decision_s"] > 0 and "batched_decision_s" not in dense
    assert probe["decision_s"] > 0 and probe["decode_steps_tok_s"] >= probe["decode_tok_s"]
    with pytest.raises(ValueError, match="needs --calibration"):
        bench_prune(["smollm2-135m", "probe:0.3"], engine, 4, 1, 2)
    with pytest.raises(ValueError, match="write Probe Pruning as probe:RATIO"):
        bench_prune(["smollm2-135m", "probe:x"], engine, 4, 1, 2, calibration=CALIBRATION)
