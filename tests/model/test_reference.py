"""The real default model against HF transformers (the reference) on the same GGUF, float32."""

from __future__ import annotations

import pytest
import torch

from brisk import SamplingParams
from brisk.model.attention import ContiguousAttention, SeqSpan
from brisk.runtime.model_runner import allocate_contiguous_kv

PROMPTS = [
    "The history of the Roman Empire begins with",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Les montagnes enneigées du Québec sont magnifiques en hiver, et les 🏔️ attirent",
    "Q: What is 17 multiplied by 23?\nA:",
]
CHAT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]


@pytest.fixture(scope="module")
def prompt_ids(brisk_llm) -> list[list[int]]:
    tok = brisk_llm.get_tokenizer()
    return [tok.encode(p) for p in PROMPTS] + [tok.encode_chat(CHAT)]


def _brisk_logits(llm, ids: list[int]) -> torch.Tensor:
    model = llm.model
    caches = allocate_contiguous_kv(model.config, 1, len(ids), torch.float32, "cpu")
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(caches, [SeqSpan(0, 0, len(ids), 0)]))
        return model.compute_logits(hidden)


def test_logits_match_hf_on_varied_prompts(brisk_llm, hf_model, prompt_ids) -> None:
    assert len(prompt_ids) >= 5
    for ids in prompt_ids:
        ours = _brisk_logits(brisk_llm, ids)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), "argmax differs at some position"
        logit_range = float(ref.max() - ref.min())
        assert float((ours - ref).abs().max()) < 1e-4 * logit_range


def test_greedy_64_tokens_identical_to_hf_generate(brisk_llm, hf_model, prompt_ids) -> None:
    """Code and the chat prompt (HF's generate takes ~8 s a prompt here; the logits test above
    holds every prompt to HF at every position)."""
    chosen = [prompt_ids[1], prompt_ids[-1]]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outs = brisk_llm.generate([{"prompt_token_ids": ids} for ids in chosen], params, use_tqdm=False)
    for ids, out in zip(chosen, outs):
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, min_new_tokens=64,
                                    do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"


def test_converted_hf_directory_gives_identical_logits(brisk_llm, hf_model, prompt_ids, tmp_path) -> None:
    """`brisk convert` writes a directory that both brisk and HF transformers load to the same model."""
    transformers = pytest.importorskip("transformers")
    from brisk import LLM
    from brisk.loader.convert import convert

    out = convert("smollm2-135m", tmp_path / "smollm2")
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                "tokenizer_config.json", "generation_config.json"}
    from_dir = LLM(str(out), max_model_len=256)
    ids = prompt_ids[0]
    assert from_dir.get_tokenizer().encode(PROMPTS[0]) == ids
    assert torch.equal(_brisk_logits(from_dir, ids), _brisk_logits(brisk_llm, ids))
    hf_dir = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_dir(torch.tensor([ids])).logits[0], hf_model(torch.tensor([ids])).logits[0])
