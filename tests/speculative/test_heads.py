"""Residual heads: file round trip and errors, the draft vocabulary, and self-distillation
training that actually teaches a tiny model's heads its own continuations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from brisk.request import SamplingParams
from brisk.speculative.heads import DraftVocab, ResidualHeads, load_heads, save_heads
from brisk.speculative.train import HeadTraining, features, train_heads
from tests.speculative.conftest import CFG, VOCAB, run, tiny_engine, tiny_model


@pytest.mark.parametrize("sequential", [False, True])
def test_untrained_heads_are_the_identity_and_files_round_trip(tmp_path: Path, sequential: bool) -> None:
    heads = ResidualHeads(CFG.hidden_size, 3, sequential=sequential)
    h = torch.randn(5, CFG.hidden_size)
    e = torch.randn(5, CFG.hidden_size)
    assert torch.equal(heads.head(1, h, e if sequential else None), h)  # SiLU(0) = 0
    with torch.no_grad():
        heads.weight.normal_()
    path = tmp_path / "m.safetensors"
    save_heads(path, heads, "medusa", "tiny", vocab=torch.tensor([3, 1, 2]))
    model = tiny_model(0)
    loaded, meta, vocab = load_heads(path, "medusa", model)
    assert vocab is not None and vocab.token_ids.tolist() == [3, 1, 2]
    assert loaded.sequential == sequential and meta["kind"] == "medusa" and meta["base_model"] == "tiny"
    assert torch.equal(loaded.head(2, h, e if sequential else None), heads.head(2, h, e if sequential else None))
    with pytest.raises(ValueError, match="holds medusa heads, not early_exit"):
        load_heads(path, "early_exit", model)
    with pytest.raises(ValueError, match="heads for hidden size 64, this model has 32"):
        wide = ResidualHeads(64, 3, sequential=sequential)
        save_heads(tmp_path / "wide.safetensors", wide, "medusa", "tiny")
        load_heads(tmp_path / "wide.safetensors", "medusa", model)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a heads file"):
        load_heads(tmp_path / "junk.safetensors", "medusa", model)


def test_draft_vocabulary_keeps_its_tokens_logits_and_masks_the_rest(tmp_path: Path) -> None:
    model = tiny_model(0)
    vocab = DraftVocab(torch.tensor([5, 2, 9]), model)
    h = torch.randn(4, CFG.hidden_size)
    full = model.compute_logits(h)
    sub = vocab.logits(h)
    assert torch.allclose(sub[:, [5, 2, 9]], full[:, [5, 2, 9]], atol=1e-5)
    assert torch.isinf(sub).sum() == 4 * (VOCAB - 3)
    path = tmp_path / "h.safetensors"
    save_heads(path, ResidualHeads(CFG.hidden_size, 1), "medusa", "tiny", vocab=torch.tensor([VOCAB + 3]))
    with pytest.raises(ValueError, match="does not fit a 16-token model"):
        load_heads(path, "medusa", model)


def test_a_quantized_head_keeps_its_draft_rows_in_their_stored_format() -> None:
    """int4 (8-bit head in groups of 32): the subset is a GroupLinear of the chosen rows, whose
    logits are the full head's at those tokens, in 3/16 of its bytes."""
    from brisk import quant
    from brisk.config import QuantConfig
    from brisk.quant.grouped import GroupLinear

    model = tiny_model(0)
    quant.apply(model, QuantConfig.parse("int4", {"group_size": 32}))
    assert isinstance(model.lm_head, GroupLinear)
    ids = torch.tensor([5, 2, 9])
    vocab = DraftVocab(ids, model)
    assert isinstance(vocab.head, GroupLinear) and vocab.head.bits == 8 and vocab.head.out_features == 3
    head_bytes = sum(t.numel() * t.element_size() for t in model.lm_head.buffers())
    assert vocab.nbytes * VOCAB == head_bytes * 3
    h = torch.randn(4, CFG.hidden_size)
    full = model.compute_logits(h)
    assert torch.allclose(vocab.logits(h)[:, ids], full[:, ids], atol=1e-5)
    assert torch.isinf(vocab.logits(h)).sum() == 4 * (VOCAB - 3)


def test_self_distillation_teaches_the_heads_the_model_s_continuations() -> None:
    model = tiny_model(7)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (4,), generator=g).tolist() for _ in range(60)]
    outs = run(tiny_engine(model, blocks=256, seqs=16), prompts, SamplingParams(max_tokens=24, temperature=0,
                                                                                 ignore_eos=True))
    sequences = [(p + outs[f"r{i}"], len(p)) for i, p in enumerate(prompts)]
    for kind, sequential in (("medusa", False), ("medusa", True), ("early_exit", False)):
        cfg = HeadTraining(kind=kind, num_heads=2 if kind == "medusa" else 1, exit_layer=1, epochs=30, lr=1e-2,
                           batch_size=64, sequential=sequential)
        train, held = features(model, sequences[6:], cfg), features(model, sequences[:6], cfg)
        assert train.targets.shape[1] == cfg.num_heads
        heads, report = train_heads(model, train, held, cfg, vocab=torch.arange(VOCAB - 2))
        assert heads.sequential == sequential
        before, after = report["before"], report["after"]
        # the next-token head learns a lot; further heads guess further ahead and gain less
        assert after[0] > before[0] + 0.1 and sum(after) > sum(before) + 0.1, (kind, sequential, before, after)


def test_prompts_file_takes_plain_lines_and_json_lines(tmp_path: Path) -> None:
    from brisk.engine.train_heads import _read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('What is tea?\n\n{"prompt": "Summarize this.\\n\\nA passage."}\n', encoding="utf-8")
    assert _read_prompts(path) == ["What is tea?", "Summarize this.\n\nA passage."]
    path.write_text('{"messages": []}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 1: a JSON line needs a \"prompt\" string"):
        _read_prompts(path)
    path.write_text('{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=":1: not valid JSON"):
        _read_prompts(path)
