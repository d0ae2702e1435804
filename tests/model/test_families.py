"""Families beyond Llama (Gemma 3, Qwen3, Phi-3) and sliding-window attention, built from tiny random HF
configs in the test (no download): logits equal HF transformers' at every position, and greedy
continuations through the paged engine (chunked prefill, prefix caching, the paged kernel and the
gather path) equal HF's `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from brisk.config import CacheConfig, SchedulerConfig
from brisk.engine.llm_engine import LLMEngine
from brisk.loader.hf_loader import hf_config_dict, hf_model_config
from brisk.model.base import CausalLM, forward_sequence
from brisk.model.registry import build_model
from brisk.request import SamplingParams
from tests.speculative.conftest import run, tiny_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB, WINDOW = 96, 8
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _gemma3_config() -> object:
    # head_dim 32 with hidden 64 and 4 heads (independent), a query_pre_attn_scalar that is not
    # head_dim, both layer kinds, a window shorter than the prompts, soft-capped logits
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, final_logit_softcapping=30.0, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _qwen3_config() -> object:
    return transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _mistral_config() -> object:
    return transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW)


# LongRoPE factors, one per rotated pair (head_dim 16): short within the original window, long beyond
SHORT, LONG = [1.0 + 0.1 * i for i in range(8)], [1.5 + 0.3 * i for i in range(8)]


def _phi3_config(sliding_window: int | None = WINDOW) -> object:
    # fused qkv_proj / gate_up_proj, LongRoPE with an original window of 256 in a 512 context (so
    # HF's attention factor is sqrt(1 + ln 2 / ln 256)), every layer sliding
    return transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=256,
        rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        sliding_window=sliding_window, pad_token_id=0, bos_token_id=1, eos_token_id=2)


CONFIGS = {"gemma3": (_gemma3_config, transformers.Gemma3ForCausalLM),
           "qwen3": (_qwen3_config, transformers.Qwen3ForCausalLM),
           "mistral": (_mistral_config, transformers.MistralForCausalLM),
           "phi3": (_phi3_config, transformers.Phi3ForCausalLM)}


def _pair(family: str, tmp_path: Path, max_positions: int = 256, config: object = None
          ) -> tuple[CausalLM, torch.nn.Module]:
    """A brisk model and an HF model holding the same random weights; brisk reads the config
    through its own HF config parser."""
    make_config, hf_class = CONFIGS[family]
    torch.manual_seed(0)
    hf = hf_class(config or make_config()).float().eval()
    with torch.no_grad():  # random norms too (Gemma's init at 0 would hide a missing 1 + w)
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if family == "gemma3" else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3)
    hf.config.save_pretrained(tmp_path)
    cfg = hf_model_config(tmp_path)
    ours = build_model(cfg, torch.float32, max_positions=max_positions)
    with torch.no_grad():
        ours.load_weights(hf.state_dict().items())
    return ours.eval(), hf


IDS = [int(i) for i in torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1))]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logits_match_hf_at_every_position(family: str, tmp_path: Path) -> None:
    ours, hf = _pair(family, tmp_path)
    got = ours.compute_logits(forward_sequence(ours, IDS))
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    torch.testing.assert_close(got, ref, atol=5e-5, rtol=1e-4)


def test_longrope_beyond_the_original_window_uses_the_long_factors(tmp_path: Path) -> None:
    """A Phi-3 run whose context passes the original window (256) rotates with the long factors:
    a 300-token sequence gives HF's logits (HF too picks the long factors for a sequence that long)."""
    ours, hf = _pair("phi3", tmp_path, max_positions=512, config=_phi3_config(sliding_window=None))
    ids = [int(i) for i in torch.randint(3, VOCAB, (300,), generator=torch.Generator().manual_seed(3))]
    got = ours.compute_logits(forward_sequence(ours, ids))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    short, _ = _pair("phi3", tmp_path, max_positions=256, config=_phi3_config(sliding_window=None))
    assert not torch.allclose(short.compute_logits(forward_sequence(short, ids[:256]))[-1], ref[255], atol=1e-3)


def test_config_round_trips_through_hf_config_json(tmp_path: Path) -> None:
    """hf_config_dict (what `brisk convert` writes) reads back as the same config, for HF too."""
    ours, _ = _pair("gemma3", tmp_path)
    cfg = ours.config
    assert cfg.layer_types == ("sliding", "full", "sliding", "sliding") and cfg.sliding_window == WINDOW
    assert (cfg.qk_norm, cfg.hidden_act, cfg.attn_scale) == (True, "gelu_tanh", 24 ** -0.5)
    out = tmp_path / "again"
    out.mkdir()
    import json

    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    assert hf_model_config(out) == cfg
    assert hasattr(transformers, hf_config_dict(cfg)["architectures"][0])
    hf_again = transformers.AutoConfig.from_pretrained(out)
    assert hf_again.layer_types == ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert hf_again.query_pre_attn_scalar == 24


def test_partial_rotary_gives_hf_logits_through_every_path(tmp_path: Path) -> None:
    """Phi-4-mini's partial rotary (3/4 of each head, here 12 of 16 dims): q / k dims laid out so the
    full-width kernels rotate exactly HF's pairs; logits at every position and greedy through the
    paged engine (kernel, decode plan, gather) equal HF's."""
    cfg = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, partial_rotary_factor=0.75, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    ours, hf = _pair("phi3", tmp_path, config=cfg)
    assert ours.config.rotary_dim == 12
    got = ours.compute_logits(forward_sequence(ours, IDS))
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    torch.testing.assert_close(got, ref, atol=5e-5, rtol=1e-4)
    prompts = [IDS[:30], IDS[3:14]]
    assert _run(_engine(ours, 12), prompts) == [_hf_greedy(hf, p) for p in prompts]
    assert hf_config_dict(ours.config)["partial_rotary_factor"] == 0.75


def test_phi3_config_round_trips_with_its_longrope(tmp_path: Path) -> None:
    import json

    ours, _ = _pair("phi3", tmp_path)
    cfg = ours.config
    assert cfg.rope_scaling.factor == 2.0 and cfg.rope_scaling.short_factor == tuple(SHORT)
    out = tmp_path / "again"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    assert hf_model_config(out) == cfg
    hf_again = transformers.AutoConfig.from_pretrained(out)
    assert hf_again.rope_parameters["long_factor"] == LONG and hf_again.sliding_window == WINDOW


def test_llama_config_names_hfs_llama_class() -> None:
    """What `brisk convert` writes for the Llama family names HF's class, so HF loads the folder."""
    from brisk.config import ModelConfig

    out = hf_config_dict(ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
    assert out["architectures"] == ["LlamaForCausalLM"] and hasattr(transformers, out["architectures"][0])


def _engine(model: CausalLM, budget: int, caching: bool = True) -> LLMEngine:
    return LLMEngine(model, tiny_tokenizer(), CacheConfig(block_size=4, num_kv_blocks=96, enable_prefix_caching=caching),
                     SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=128))


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    out = run(engine, prompts, GREEDY)
    return [out[f"r{i}"] for i in range(len(prompts))]


def _hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    hf.generation_config.eos_token_id = None  # like ignore_eos: EOS is neither a stop nor masked
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["gemma3", "mistral", "phi3"])
def test_greedy_through_the_paged_engine_equals_hf(family: str, tmp_path: Path) -> None:
    """Prompts longer than the window, fed in chunks of 12 (gather path) or as one span of at most
    16 (the paged kernel); a shared prefix is served from the cache the second time."""
    ours, hf = _pair(family, tmp_path)
    prompts = [IDS[:30], IDS[:30] + IDS[:5], IDS[3:14]]
    expected = [_hf_greedy(hf, p) for p in prompts]
    for budget, caching in ((12, True), (64, True), (64, False)):
        assert _run(_engine(ours, budget, caching), prompts) == expected, (budget, caching)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_decode_plan_gives_the_module_path_numbers_bit_for_bit(family: str, tmp_path: Path) -> None:
    """Gemma 3's post norms, QK norm, GELU, windows and two rotary tables, Qwen3's QK norm and
    Mistral's window in the C++ plan: the same tokens and log-probabilities as module by module."""
    from brisk.runtime.decode_plan import plan_supported

    if not plan_supported():
        pytest.skip("needs the AVX-512 kernels")
    ours, _ = _pair(family, tmp_path)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [IDS[:30], IDS[5:9], IDS[:30] + IDS[:3]]
    results = []
    for use_plan in (True, False):
        engine = _engine(ours, 64)
        engine.runner.plans.enabled = use_plan
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        outs: dict[str, object] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    c = o.outputs[0]
                    outs[o.request_id] = (list(c.token_ids), [(s.logprob, s.top) for s in c.logprobs])
        results.append(outs)
        if use_plan:
            assert engine.runner.plans.current, "the plan should serve this model"
    assert results[0] == results[1]


@pytest.mark.parametrize("short_spans", ["kernel", "padded", "gather"])
def test_sliding_groups_let_blocks_go_and_keep_outputs_through_preemption_and_prefix_hits(
        short_spans: str, tmp_path: Path) -> None:
    """Gemma 3's sliding layers hold only their window's blocks (NO_BLOCK before it) in a pool too
    small for three long requests at once: preemptions happen, the shared 40-token prefix is hit
    (its window's blocks included), and every output is still HF's, whichever path short spans
    take (the CPU kernel and the decode plan, CUDA's padded SDPA, the gather path)."""
    check_sliding_groups(short_spans, tmp_path, "cpu")


def check_sliding_groups(short_spans: str, tmp_path: Path, device: str) -> None:
    """The sliding-groups check above with the model on `device` (tests/model/test_cuda_families.py)."""
    from brisk.core.kv_cache_manager import NO_BLOCK

    ours, hf = _pair("gemma3", tmp_path)
    prompts = [IDS[:40], IDS[:40] + IDS[5:9], IDS[10:30]]
    expected = [_hf_greedy(hf, p) for p in prompts]
    engine = LLMEngine(ours.to(device), tiny_tokenizer(), CacheConfig(block_size=4, num_kv_blocks=64, enable_prefix_caching=True),
                       SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=128))
    assert [g.window for g in engine.runner.groups] == [0, WINDOW, WINDOW, WINDOW]
    if short_spans == "kernel" and engine.runner.short_spans != "kernel":
        pytest.skip("needs brisk's C++ paged kernel")
    engine.runner.short_spans = short_spans
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    outs: dict[str, list[int]] = {}
    let_go = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        engine.scheduler.check_invariants()
        for r in engine.scheduler.running:
            let_go = max(let_go, sum(b == NO_BLOCK for t in engine.scheduler.kv.get_block_ids(r.request_id) for b in t))
    assert [outs[f"r{i}"] for i in range(3)] == expected
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_hit_rate > 0 and let_go > 0
