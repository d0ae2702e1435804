"""Tiny random Llama-family models built in the test (no files): shapes, GQA/MQA, rotary scaling,
QKV bias, incremental decoding, all against HF transformers on the same random weights."""

from __future__ import annotations

import pytest
import torch

from brisk.config import ModelConfig, RopeScaling
from brisk.model.attention import ContiguousAttention, SeqSpan
from brisk.model.llama import LlamaForCausalLM
from brisk.runtime.model_runner import ModelRunner, SeqStep, allocate_contiguous_kv

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, HEADS = 96, 64, 2, 4


def _pair(kv_heads: int = 2, rope_scaling: dict | None = None, arch: str = "llama", max_pos: int = 64,
          tie: bool = False) -> tuple[LlamaForCausalLM, torch.nn.Module]:
    """A brisk model and an HF model holding identical random weights."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie)
    if arch == "qwen2":
        hf_cfg = transformers.Qwen2Config(**common, rope_scaling=rope_scaling)
        hf = transformers.Qwen2ForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.LlamaConfig(**common, rope_scaling=rope_scaling)
        hf = transformers.LlamaForCausalLM(hf_cfg)
    hf = hf.float().eval()
    with torch.no_grad():  # random norms too, so a missing norm weight would show
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    cfg = ModelConfig(architecture=arch, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_pos, rms_norm_eps=1e-5, rope_theta=10000.0,
                      rope_scaling=RopeScaling.from_hf(rope_scaling), attention_bias=arch == "qwen2",
                      tie_word_embeddings=tie)
    ours = LlamaForCausalLM(cfg, max_positions=4 * max_pos)
    with torch.no_grad():
        ours.load_weights(hf.state_dict().items())
    return ours.eval(), hf


def _full_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    caches = allocate_contiguous_kv(model.config, 1, 256, torch.float32, "cpu")
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(caches, [SeqSpan(0, 0, len(ids), 0)]))
        return model.compute_logits(h)


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


IDS = [int(i) for i in torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))]


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_logits_match_hf_for_head_layouts(kv_heads: int) -> None:
    ours, hf = _pair(kv_heads=kv_heads)
    got, ref = _full_logits(ours, IDS), _hf_logits(hf, IDS)
    assert got.shape == (len(IDS), VOCAB)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
], ids=lambda s: s["rope_type"])
def test_rope_scaling_matches_hf(scaling: dict) -> None:
    ours, hf = _pair(rope_scaling=scaling)
    torch.testing.assert_close(_full_logits(ours, IDS), _hf_logits(hf, IDS), atol=2e-5, rtol=1e-4)


def test_dynamic_ntk_matches_hf_incremental_decoding_past_the_window() -> None:
    """Past the trained window HF re-bases per step; per-position tables reproduce its decode."""
    ours, hf = _pair(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_pos=16)
    prompt = IDS[:12]
    with torch.no_grad():
        ids = torch.tensor([prompt])  # explicit mask: the prompt contains the pad id
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    runner = ModelRunner(ours, max_seqs=1, max_len=64)
    logits = runner.execute([SeqStep(0, 0, prompt)])
    got = []
    for step in range(20):
        got.append(int(logits.argmax()))
        logits = runner.execute([SeqStep(0, len(prompt) + step, [got[-1]])])
    assert got == ref


def test_qwen2_qkv_bias_and_tied_embeddings() -> None:
    ours, hf = _pair(arch="qwen2", tie=True)
    assert ours.lm_head is None
    torch.testing.assert_close(_full_logits(ours, IDS), _hf_logits(hf, IDS), atol=2e-5, rtol=1e-4)


def test_incremental_prefill_and_decode_equal_full_forward() -> None:
    """A prompt fed as chunk + chunk (masked path) + single tokens gives the full forward's logits."""
    ours, _ = _pair()
    full = _full_logits(ours, IDS)
    runner = ModelRunner(ours, max_seqs=2, max_len=64)
    rows = [runner.execute([SeqStep(1, 0, IDS[:10])])[0]]
    rows.append(runner.execute([SeqStep(1, 10, IDS[10:25])])[0])
    for i in range(25, len(IDS)):
        rows.append(runner.execute([SeqStep(1, i, [IDS[i]])])[0])
    torch.testing.assert_close(torch.stack(rows), full[[9, 24, *range(25, len(IDS))]], atol=2e-5, rtol=1e-4)


def test_two_sequences_in_one_batch_equal_separate_runs() -> None:
    ours, _ = _pair()
    a, b = IDS[:13], IDS[20:27]
    runner = ModelRunner(ours, max_seqs=2, max_len=64)
    both = runner.execute([SeqStep(0, 0, a), SeqStep(1, 0, b)])
    torch.testing.assert_close(both[0], _full_logits(ours, a)[-1], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(both[1], _full_logits(ours, b)[-1], atol=2e-5, rtol=1e-4)
    nxt = runner.execute([SeqStep(0, len(a), [5]), SeqStep(1, len(b), [7])])
    torch.testing.assert_close(nxt[0], _full_logits(ours, a + [5])[-1], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(nxt[1], _full_logits(ours, b + [7])[-1], atol=2e-5, rtol=1e-4)


def test_bfloat16_close_to_float32() -> None:
    ours, _ = _pair()
    ref = _full_logits(ours, IDS)
    ours16 = LlamaForCausalLM(ours.config, dtype=torch.bfloat16, max_positions=256)
    with torch.no_grad():
        ours16.load_weights((n, p) for n, p in _hf_named(ours))
    caches = allocate_contiguous_kv(ours.config, 1, 64, torch.bfloat16, "cpu")
    with torch.inference_mode():
        h = ours16(torch.tensor(IDS), torch.arange(len(IDS)), ContiguousAttention(caches, [SeqSpan(0, 0, len(IDS), 0)]))
        got = ours16.compute_logits(h)
    assert got.dtype == torch.float32
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


def _hf_named(model: LlamaForCausalLM):
    """Our stacked parameters split back into HF names (a round trip through load_weights)."""
    cfg = model.config
    for name, p in model.named_parameters():
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            q, k, v = p.split((cfg.q_size, cfg.kv_size, cfg.kv_size))
            yield from ((base + "q_proj.weight", q), (base + "k_proj.weight", k), (base + "v_proj.weight", v))
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            g, u = p.chunk(2)
            yield from ((base + "gate_proj.weight", g), (base + "up_proj.weight", u))
        else:
            yield name, p


def test_load_weights_rejects_wrong_shapes_and_missing_tensors() -> None:
    ours, hf = _pair()
    state = dict(hf.state_dict())
    state.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing tensors: norm.weight"):
        LlamaForCausalLM(ours.config).load_weights(state.items())
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="does not fit"):
        LlamaForCausalLM(ours.config).load_weights(state.items())
    with pytest.raises(ValueError, match="has no place"):
        LlamaForCausalLM(ours.config).load_weights([("model.layers.0.bogus.weight", torch.zeros(1))])


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="multiple of"):
        ModelConfig(num_attention_heads=9, num_key_value_heads=2)
    with pytest.raises(ValueError, match="unsupported rope scaling type"):
        RopeScaling(rope_type="mrope")
    with pytest.raises(ValueError, match="longrope scaling needs short_factor"):
        RopeScaling(rope_type="longrope")
    with pytest.raises(ValueError, match="short_factor has 3 values; 8 rotated dims need 4"):
        ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, rope_scaling=RopeScaling(
            rope_type="longrope", short_factor=(1.0,) * 3, long_factor=(1.0,) * 3, original_max_position_embeddings=8))
