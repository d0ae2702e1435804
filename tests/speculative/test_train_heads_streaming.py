"""`brisk train-heads --kind streaming` end to end on a tiny chat model: the target answers, the
streams train, the file loads and its report says what it costs; the kept answers are reused only
by the run that wrote them; a diverging run keeps the last whole epoch's streams and says where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from brisk.cli import main
from brisk.loader.load import load_model
from brisk.speculative.heads import read_heads_file
from brisk.speculative.streaming import KIND, load_streams
from tests.parallel.conftest import write_tiny


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny model with a chat template, a prompts file of 12 prompts)."""
    root = tmp_path_factory.mktemp("train_heads")
    model = write_tiny(root / "model", seed=3)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                               "{% if add_generation_prompt %}w4{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(f"w{3 + i} w{20 + 2 * i}" for i in range(12)) + "\n")
    return model, prompts


def _argv(model: Path, prompts: Path, out: Path, sequences: Path, *extra: str) -> list[str]:
    return ["train-heads", "--model", str(model), "--kind", "streaming", "--out", str(out),
            "--prompts-file", str(prompts), "--sequences", str(sequences), "--num-prompts", "12",
            "--max-tokens", "24", "--epochs", "2", "--num-heads", "2", "--stream-layers", "1", "--lora-rank", "2",
            "--draft-vocab", "0", *extra]


def test_streaming_heads_train_end_to_end_and_report_their_cost(chat_model, tmp_path: Path, capsys) -> None:
    model, prompts = chat_model
    out, sequences = tmp_path / "streams.safetensors", tmp_path / "answers.json"
    assert main(_argv(model, prompts, out, sequences)) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["kind"] == "streaming" and report["num_streams"] == 2 and report["stream_layers"] == 1
    assert report["generated_tokens"] == 12 * 24 and report["sequences"] == 11  # the first tenth (1) held out
    assert 0 < report["extra_params_fraction"] == pytest.approx(report["extra_params"] / _params(model), rel=1e-3)
    assert "perplexity are the original's" in report["main_stream"]
    assert len(report["before"]) == len(report["after"]) == 2
    adapter, meta, _ = load_streams(out, load_model(str(model)).model)
    assert adapter.num_streams == 2 and meta["generated_tokens"] == str(12 * 24) and meta["epochs_done"] == "2"
    kept = json.loads(sequences.read_text())
    assert kept["key"]["max_tokens"] == 24 and len(kept["sequences"]) == 12
    # the kept answers are read again by the same run (no generation: the engine would be slower than this)
    assert main(_argv(model, prompts, tmp_path / "again.safetensors", sequences)) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["generated_tokens"] == 12 * 24
    # ...and refused by a run that would have generated other answers
    assert main(_argv(model, prompts, tmp_path / "other.safetensors", sequences, "--max-tokens", "16")) == 2
    err = capsys.readouterr().err
    assert "holds answers of another run: max_tokens 24 (this run: 16)" in err
    assert not (tmp_path / "other.safetensors").exists()


def test_a_diverging_stream_training_keeps_the_last_epoch(chat_model, tmp_path: Path, capsys,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import brisk.engine.train_heads as heads_module
    import brisk.speculative.train_streams as module

    model, prompts = chat_model
    out, sequences = tmp_path / "streams.safetensors", tmp_path / "answers.json"
    real_loss, real_save, saved = module.F.cross_entropy, heads_module.save_streams, []

    def save_then_break(*args, **kwargs):  # the first epoch's streams are written, then the loss breaks
        real_save(*args, **kwargs)
        saved.append(1)

    def nan_after_the_first_epoch(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        return loss * float("nan") if saved else loss

    monkeypatch.setattr(heads_module, "save_streams", save_then_break)
    monkeypatch.setattr(module.F, "cross_entropy", nan_after_the_first_epoch)
    assert main(_argv(model, prompts, out, sequences)) == 2
    err = capsys.readouterr().err
    assert f"stream training diverged (epoch 2: a loss of nan; that step was not taken); {out} holds the " \
           f"streams after epoch 1: continue from them with --init {out}" in err
    meta, _ = read_heads_file(out, KIND)
    assert meta["epochs_done"] == "1"
    assert not Path(f"{out}.tmp").exists()
    load_streams(out, load_model(str(model)).model)  # whole, and loads


def _params(model: Path) -> int:
    cfg = load_model(str(model)).config
    return sum(cfg.layer_params(i) for i in range(cfg.num_hidden_layers)) + \
        cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
