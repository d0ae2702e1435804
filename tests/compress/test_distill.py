"""Distillation (compress/distill.py) on tiny random teacher / student pairs written as HF folders:
the loss falls and KL to the teacher drops, a checkpoint resumes bit for bit (on-policy steps
included), the written student reloads, generates and serves as an exact draft, the data and the
losses are what they say, and every bad input is refused with a message that names it."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.cli_distill import layer_list
from brisk.compress.distill import (
    Distiller,
    Run,
    check_bf16,
    distill_loss,
    logits_of,
)
from brisk.compress.distill_data import derived_student, on_policy_step, sample_continuations, text_corpus
from brisk.config import DistillConfig
from brisk.engine.distill_job import DistillJob, distill
from brisk.loader.load import load_model
from brisk.model.base import forward_sequence
from tests.parallel.conftest import TINY, TINY_GEMMA, VOCAB, write_tiny


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(teacher dir, student dir, text file): two random tiny Qwen2 models with one tokenizer, and
    a text the teacher wrote itself (so there is something to learn)."""
    root = tmp_path_factory.mktemp("distill")
    teacher = write_tiny(root / "teacher", seed=0)
    student = write_tiny(root / "student", seed=1)
    llm = LLM(str(teacher), max_model_len=256)
    prompts = [" ".join(f"w{random.Random(i).randrange(VOCAB)}" for _ in range(4)) for i in range(24)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=120, temperature=1.0, seed=5, ignore_eos=True),
                        use_tqdm=False)
    text = root / "text.txt"
    text.write_text("\n".join(p + " " + " ".join(f"w{t}" for t in o.outputs[0].token_ids)
                              for p, o in zip(prompts, outs)))
    return teacher, student, text


CFG = DistillConfig(steps=40, batch_size=4, seq_len=32, lr=3e-3, warmup=2, eval_tokens=256, eval_every=20,
                    checkpoint_every=20)


def test_loss_falls_and_kl_to_the_teacher_drops(pair, tmp_path: Path) -> None:
    teacher, student, text = pair
    report = distill(DistillJob(str(teacher), tmp_path / "out", str(student), text=text), CFG, progress=False)
    first, last = report["eval"][0], report["eval"][-1]
    assert [e["step"] for e in report["eval"]] == [0, 20, 40]
    assert last["kl"] < 0.5 * first["kl"] and last["ppl"] < first["ppl"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["brisk_distill"]["eval"] == report["eval"] and config["brisk_distill"]["loss"] == "fkl"
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["step-000020", "step-000040"]


def test_the_written_student_reloads_generates_and_drafts_exactly(pair, tmp_path: Path) -> None:
    """The directory holds the trained weights (its logits are the trained student's), loads like
    any model, and as a draft keeps the teacher's greedy output exactly."""
    teacher, student, text = pair
    cfg = dataclasses.replace(CFG, steps=6, eval_every=6, checkpoint_every=6)
    t, s = load_model(str(teacher)), load_model(str(student))
    corpus = text_corpus(t.tokenizer, text, cfg)
    trainer = Distiller(t, s, corpus, Run(str(teacher), str(student), {}, corpus.source, cfg), tmp_path / "out")
    for _ in range(cfg.steps):
        trainer.train_step()
    from brisk.compress.distill import write_student

    write_student(trainer, 1.0, 1)
    reloaded = load_model(str(tmp_path / "out")).model
    ids = corpus.held_out[0]
    with torch.no_grad():
        assert torch.equal(forward_sequence(reloaded, ids), forward_sequence(s.model, ids))
    prompts = ["w3 w5 w7", "w1 w2"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(str(teacher), max_model_len=256).generate(prompts, greedy, use_tqdm=False)
    spec = LLM(str(teacher), max_model_len=256,
               speculative_config={"method": "draft", "model": str(tmp_path / "out"), "num_speculative_tokens": 3})
    got = spec.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in got) > 0
    # FR-Spec: the ranking of the training tokens is written beside the student; an int8 draft
    # drafting among its 40 most frequent tokens keeps the greedy output exactly
    ranking = {k: torch.tensor(v) for k, v in json.loads((tmp_path / "out" / "draft_vocab.json").read_text()).items()}
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    for seq in corpus.train:
        counts += torch.bincount(torch.tensor(seq), minlength=VOCAB)
    assert torch.equal(ranking["counts"], counts) and counts[ranking["ranked"][:40]].min() >= counts.max() // 100
    assert counts[ranking["ranked"]].diff().le(0).all()
    frs = LLM(str(teacher), max_model_len=256, speculative_config={
        "method": "draft", "model": str(tmp_path / "out"), "num_speculative_tokens": 3, "quantization": "int8",
        "draft_vocab": 40})
    got = frs.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    drafted = frs.engine.spec.proposer.vocab.token_ids.tolist()
    assert len(drafted) == 40 and sum(o.metrics.num_draft_tokens for o in got) > 0
    with pytest.raises(ValueError, match="draft vocabulary file"):
        LLM(str(teacher), max_model_len=256, speculative_config={"method": "draft", "model": str(teacher),
                                                                 "draft_vocab": 40})


def _trainer(pair, out: Path, cfg: DistillConfig) -> Distiller:
    teacher, student, text = pair
    t, s = load_model(str(teacher)), load_model(str(student))
    corpus = text_corpus(t.tokenizer, text, cfg)
    return Distiller(t, s, corpus, Run(str(teacher), str(student), {"layers": 4}, corpus.source, cfg), out)


def test_resume_continues_bit_for_bit_on_and_off_policy(pair, tmp_path: Path) -> None:
    cfg = dataclasses.replace(CFG, steps=8, on_policy=0.5, prompt_tokens=8, loss="rkl")
    first = _trainer(pair, tmp_path / "run", cfg)
    for _ in range(3):
        first.train_step()
    checkpoint = first.save_checkpoint()
    after = [first.train_step() for _ in range(4)]
    resumed = _trainer(pair, tmp_path / "run", cfg)
    resumed.load_checkpoint(tmp_path / "run")  # the run's directory: its latest checkpoint
    assert resumed.step == 3 and checkpoint.name == "step-000003"
    assert [resumed.train_step() for _ in range(4)] == after
    assert any(on_policy_step(cfg.seed, step, cfg.on_policy) for step in range(3, 7))  # the student's own samples
    assert not all(on_policy_step(cfg.seed, step, cfg.on_policy) for step in range(3, 7))  # and the text


def test_a_checkpoint_of_another_run_is_refused(pair, tmp_path: Path) -> None:
    first = _trainer(pair, tmp_path / "run", CFG)
    first.train_step()
    first.save_checkpoint()
    other = _trainer(pair, tmp_path / "other", dataclasses.replace(CFG, loss="tvd"))
    with pytest.raises(ValueError, match="checkpoint of another run: its config"):
        other.load_checkpoint(tmp_path / "run")
    with pytest.raises(ValueError, match="no checkpoint there"):
        other.load_checkpoint(tmp_path / "nowhere")


def test_a_diverging_loss_stops_with_the_last_good_checkpoint(pair, tmp_path: Path, monkeypatch) -> None:
    teacher, student, text = pair
    import brisk.compress.distill as module

    real = module.distill_loss
    calls = []

    def breaks_at_step_4(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * float("nan") if len(calls) == 4 else loss

    monkeypatch.setattr(module, "distill_loss", breaks_at_step_4)
    cfg = dataclasses.replace(CFG, checkpoint_every=2, eval_every=100)
    with pytest.raises(ValueError, match=r"stopped at step 4: a loss of nan .*step-000002"):
        distill(DistillJob(str(teacher), tmp_path / "out", str(student), text=text), cfg, progress=False)
    assert (tmp_path / "out" / "checkpoints" / "step-000002" / "state.json").is_file()
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_full_disk_leaves_the_last_checkpoint_and_student_whole(pair, tmp_path: Path, monkeypatch) -> None:
    """A write that fails half-way (ENOSPC) removes its temporary files, names what failed, and
    leaves the previous checkpoint and the previously written student as they were."""
    import errno

    import brisk.compress.distill as module
    from brisk.compress.distill import write_student

    cfg = dataclasses.replace(CFG, steps=2, eval_every=100)
    trainer = _trainer(pair, tmp_path / "out", cfg)
    trainer.train_step()
    first = trainer.save_checkpoint()
    write_student(trainer, 1.0, 1)
    written = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()}
    trainer.train_step()
    real = module.save_file

    def fills_the_disk(tensors, path, *args, **kwargs):
        real(tensors, path, *args, **kwargs)  # a partial file exists when the disk runs out
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module, "save_file", fills_the_disk)
    with pytest.raises(ValueError, match=r"writing checkpoint .*step-000002 failed \(No space left on device\); "
                                         r"nothing half-written was left"):
        trainer.save_checkpoint()
    with pytest.raises(ValueError, match=r"writing the student .* --resume"):
        write_student(trainer, 1.0, 1)
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == [first.name]
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()} == written
    monkeypatch.setattr(module, "save_file", real)
    again = _trainer(pair, tmp_path / "again", cfg)
    again.load_checkpoint(first)
    assert again.step == 1


def test_bad_inputs_name_what_is_wrong(pair, tmp_path: Path) -> None:
    teacher, student, text = pair
    other = write_tiny(tmp_path / "other_vocab", cfg=dataclasses.replace(TINY, vocab_size=VOCAB + 8))
    cases = [
        (DistillJob(str(teacher), tmp_path / "a", str(other), text=text), CFG, "tokenizer differs from the teacher"),
        (DistillJob(str(teacher), tmp_path / "b", str(student)), CFG, "needs training text"),
        (DistillJob(str(teacher), tmp_path / "c", str(student), [0, 1], text=text), CFG, "give one or the other"),
        (DistillJob(str(teacher), tmp_path / "d", None, [2, 1], text=text), CFG, "increasing order"),
        (DistillJob(str(teacher), tmp_path / "e", None, [0, 9], text=text), CFG, "each from 0 to 3"),
        (DistillJob(str(teacher), tmp_path / "f", None, None, 4096, text=text), CFG, "student-mlp must be from 1"),
        (DistillJob(str(teacher), tmp_path / "g", str(student), text=tmp_path / "missing.txt"), CFG, "is not a file"),
        (DistillJob(str(teacher), tmp_path / "h", str(student), text=text),
         dataclasses.replace(CFG, eval_tokens=10 ** 6), "fewer than one step's"),
        (DistillJob(str(teacher), tmp_path / "i", str(student), text=text),
         dataclasses.replace(CFG, eval_tokens=CFG.seq_len - 1), "less than one window of seq_len 32.*or 0"),
        (DistillJob(str(teacher), teacher, str(student), text=text), CFG, "is the --teacher model's directory"),
        (DistillJob(str(teacher), student, str(student), text=text), CFG, "is the --student model's directory"),
        (DistillJob(str(teacher), tmp_path / "j", str(student), text=text, device="cuda:7"), CFG, "device 'cuda:7'"),
    ]
    for job, cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            distill(job, cfg, progress=False)
    for options, message in [({"loss": "kl"}, "unknown distillation loss"), ({"loss": "rkl", "top_k": 8}, "top_k"),
                             ({"on_policy": 1.5}, "on_policy"), ({"seq_len": 4}, "seq_len"), ({"lr": 0}, "lr"),
                             ({"on_policy": 0.5, "prompt_tokens": 64, "seq_len": 32}, "prompt_tokens")]:
        with pytest.raises(ValueError, match=message):
            DistillConfig(**options)
    with pytest.raises(ValueError, match="layer numbers"):
        layer_list("0,a")
    assert layer_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]


def test_losses_are_the_divergences_they_name() -> None:
    torch.manual_seed(0)
    s, t = torch.randn(6, 50), torch.randn(6, 50)
    ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
    assert torch.allclose(distill_loss("fkl", s, t), F.kl_div(ls, lt, log_target=True, reduction="batchmean"))
    assert torch.allclose(distill_loss("rkl", s, t), F.kl_div(lt, ls, log_target=True, reduction="batchmean"))
    assert torch.allclose(distill_loss("tvd", s, t), 0.5 * (ls.exp() - lt.exp()).abs().sum(-1).mean())
    assert torch.allclose(distill_loss("fkl", s, t, top_k=50), distill_loss("fkl", s, t))
    assert torch.allclose(distill_loss("fkl", s, t, temperature=2.0),
                          4 * F.kl_div(F.log_softmax(s / 2, -1), F.log_softmax(t / 2, -1), log_target=True,
                                       reduction="batchmean"))
    for kind in ("fkl", "rkl", "tvd"):
        assert float(distill_loss(kind, t, t)) == pytest.approx(0.0, abs=1e-6)
    top = distill_loss("fkl", s, t, top_k=5)
    assert 0 < float(top) and torch.isfinite(top)


@pytest.mark.parametrize("cfg", [TINY, TINY_GEMMA], ids=["qwen2", "gemma3-sliding"])
def test_training_logits_are_the_engines(cfg, tmp_path: Path) -> None:
    """Whole sequences without a cache, with gradients on (torch's ops) or off (brisk's kernels),
    give the contiguous-cache forward's logits; sequences of different lengths in one batch too."""
    model = load_model(str(write_tiny(tmp_path / "m", cfg=cfg))).model
    a, b = list(range(3, 40)), [5, 9, 11, 2, 7, 1, 30, 31, 8, 6, 4]
    with torch.no_grad():
        ref = [model.compute_logits(forward_sequence(model, s)) for s in (a, b)]
        both = logits_of(model, [a, b])
    assert torch.allclose(both[:len(a)], ref[0], atol=1e-5) and torch.allclose(both[len(a):], ref[1], atol=1e-5)
    for p in model.parameters():
        p.requires_grad_(True)
    trained = logits_of(model, [a, a])
    assert trained.requires_grad and torch.allclose(trained[:len(a)], ref[0], atol=1e-4)
    trained.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_derived_students_and_on_policy_samples(pair) -> None:
    teacher, _, _ = pair
    t = load_model(str(teacher))
    narrow = derived_student(t, [0, 3], 16)
    assert narrow.config.num_hidden_layers == 2 and narrow.config.intermediate(0) == 16
    assert torch.equal(narrow.model.layers[1].input_layernorm.weight, t.model.layers[3].input_layernorm.weight)
    same = derived_student(t, None, None)
    ids = list(range(1, 30))
    with torch.no_grad():
        assert torch.equal(forward_sequence(same.model, ids), forward_sequence(t.model, ids))
    gen = torch.Generator().manual_seed(0)
    samples = sample_continuations(t.model, [[3, 4, 5], [9]], 12, gen)
    assert [len(s) for s in samples] == [12, 12] and samples[0][:3] == [3, 4, 5] and samples[1][0] == 9
    again = sample_continuations(t.model, [[3, 4, 5], [9]], 12, torch.Generator().manual_seed(0))
    assert again == samples


def test_prompts_file_is_the_teachers_continuations(pair, tmp_path: Path) -> None:
    from brisk.engine.distill_job import prompts_corpus

    teacher, _, text = pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w3 w4\n\nw5 w6 w7\nw1\n")
    t = load_model(str(teacher))
    corpus = prompts_corpus(str(teacher), t.tokenizer, prompts, CFG, None)
    assert [len(s) for s in corpus.train + corpus.held_out] == [32, 32, 32]
    assert corpus.train[0][:2] == t.tokenizer.encode("w3 w4") and len(corpus.held_out) == 1
    long = tmp_path / "long.txt"
    long.write_text(" ".join(["w2"] * 40))
    with pytest.raises(ValueError, match="prompt 1 has 40 tokens"):
        prompts_corpus(str(teacher), t.tokenizer, long, CFG, None)


def test_chat_prompts_are_templated_kept_and_continued_on_policy_from_their_end(pair, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """--chat renders each line as a user turn; the teacher's continuations are kept beside the
    output and reused; on-policy steps continue each sequence from the end of its own prompt."""
    import shutil

    import brisk.compress.distill as distill_module
    import brisk.engine.distill_job as job_module
    from brisk.engine.distill_job import prompts_corpus

    teacher, student, _ = pair
    chat_teacher = tmp_path / "chat_teacher"
    shutil.copytree(teacher, chat_teacher)
    config = json.loads((chat_teacher / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                               "{% if add_generation_prompt %}w4{% endif %}")
    (chat_teacher / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w3 w5\nw6\nw7 w8 w9\n")
    t = load_model(str(chat_teacher))
    cache = tmp_path / "out" / "teacher_sequences.json"
    corpus = prompts_corpus(str(chat_teacher), t.tokenizer, prompts, CFG, None, chat=True, cache=cache)
    rendered = t.tokenizer.encode("w1 w3 w5 w2 w4", add_special_tokens=False)
    second = t.tokenizer.encode("w1 w6 w2 w4", add_special_tokens=False)
    assert corpus.train[0][:len(rendered)] == rendered and corpus.prompt_lens == [len(rendered), len(second)]
    assert "chat prompts" in corpus.source and cache.is_file()
    # the prompts-file format `brisk generate` reads: a "messages" line is rendered by the template too
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"messages": [{"role": "user", "content": "w3 w5"}]}\n{"prompt": "w6"}\nw7 w8 w9\n')
    assert prompts_corpus(str(chat_teacher), t.tokenizer, lines, CFG, None).prompt_lens[0] == len(rendered)
    with pytest.raises(ValueError, match="chat template"):  # a conversation needs a template
        prompts_corpus(str(teacher), load_model(str(teacher)).tokenizer, lines, CFG, None)

    def no_generation(*args, **kwargs):
        raise AssertionError("the kept continuations were generated again")

    monkeypatch.setattr(job_module, "_teacher_continuations", no_generation)
    again = prompts_corpus(str(chat_teacher), t.tokenizer, prompts, CFG, None, chat=True, cache=cache)
    assert again.train == corpus.train and again.held_out == corpus.held_out

    seen: list[list[list[int]]] = []

    def record(model, prompts, total, generator):
        seen.append(prompts)
        return [p + [3] * (total - len(p)) for p in prompts]

    monkeypatch.setattr(distill_module, "sample_continuations", record)
    cfg = dataclasses.replace(CFG, on_policy=1.0, batch_size=2, prompt_tokens=20)
    run = Run(str(chat_teacher), str(student), {}, corpus.source, cfg)
    trainer = Distiller(t, load_model(str(student)), corpus, run, tmp_path / "out")
    seqs = trainer.batch(0)
    assert sorted(len(p) for p in seen[0]) == sorted(corpus.prompt_lens) and all(len(s) == 32 for s in seqs)
    with pytest.raises(ValueError, match="has none"):
        prompts_corpus(str(teacher), load_model(str(teacher)).tokenizer, prompts, CFG, None, chat=True)


def test_cli_writes_a_student_and_prints_its_report(pair, tmp_path: Path, capsys) -> None:
    teacher, _, text = pair
    rc = main(["distill", "--teacher", str(teacher), "--student-layers", "0-1", "--out", str(tmp_path / "out"),
               "--text", str(text), "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "64",
               "--eval-every", "1"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 2 and [e["step"] for e in report["eval"]] == [0, 1, 2]
    assert report["loss"] == "fkl" and report["on_policy"] == 0.0
    assert load_model(str(tmp_path / "out")).config.num_hidden_layers == 2
    # --for-draft: DistillSpec's total variation on the student's own samples half the time
    assert main(["distill", "--teacher", str(teacher), "--student-layers", "0", "--out", str(tmp_path / "draft"),
                 "--text", str(text), "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "64",
                 "--for-draft", "--prompt-tokens", "4"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["loss"] == "tvd" and report["on_policy"] == 0.5


def test_the_default_model_teaches_a_student_cut_from_it(gguf_path: Path, tmp_path: Path) -> None:
    """The real teacher (the default model, dequantized) and a 4-layer student derived from it:
    a few steps on real text lower the held-out KL, and the written directory loads and generates."""
    text = tmp_path / "text.txt"
    text.write_text("The history of the city begins with a small settlement on the river. " * 60
                    + "Over the centuries the town grew into a centre of trade and learning. " * 60)
    cfg = DistillConfig(steps=6, batch_size=2, seq_len=64, lr=1e-3, warmup=1, eval_tokens=128, eval_every=6,
                        checkpoint_every=6)
    report = distill(DistillJob("smollm2-135m", tmp_path / "out", None, [0, 1, 2, 29], text=text), cfg,
                     progress=False)
    assert report["eval"][-1]["kl"] < report["eval"][0]["kl"]
    assert report["params"] < 0.5 * report["teacher_params"]
    llm = LLM(str(tmp_path / "out"), max_model_len=256)
    (out,) = llm.generate(["The history of the city"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8


def test_bf16_is_refused_on_a_cpu_without_bfloat16_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AVX2 CPU torch multiplies bfloat16 in a scalar loop (a step took 296 s against 21 s in
    float32): --bf16 there is refused with what to do, not run for hours."""
    import brisk.compress.distill as distill_module

    monkeypatch.setattr(distill_module, "_cpu_bf16_matmul", lambda: False)
    with pytest.raises(ValueError, match="no bfloat16 matrix instructions.*drop --bf16"):
        check_bf16(True, torch.device("cpu"))
    check_bf16(False, torch.device("cpu"))  # float32 runs anywhere
    check_bf16(True, torch.device("cuda"))  # a GPU decides for itself
    monkeypatch.setattr(distill_module, "_cpu_bf16_matmul", lambda: True)
    check_bf16(True, torch.device("cpu"))


class _InfiniteGradient(torch.autograd.Function):
    """The loss's value unchanged, its gradient infinite: an overflow in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * float("inf")


def test_infinite_gradients_stop_before_the_weights_change(pair, tmp_path: Path, monkeypatch) -> None:
    """A finite loss whose gradients overflow stops the run before the optimizer steps on them (else
    the weights turn NaN and the next checkpoint looks good); the checkpoint named is whole and finite."""
    teacher, student, text = pair
    import brisk.compress.distill as module

    real, calls = module.distill_loss, []

    def overflows_at_step_3(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return _InfiniteGradient.apply(loss) if len(calls) == 3 else loss

    monkeypatch.setattr(module, "distill_loss", overflows_at_step_3)
    for clip in (1.0, 0.0):  # with and without clipping
        calls.clear()
        out = tmp_path / f"clip{clip}"
        cfg = dataclasses.replace(CFG, checkpoint_every=2, eval_every=100, grad_clip=clip)
        with pytest.raises(ValueError, match=r"stopped at step 3: a gradient norm of (inf|nan) \(diverged; the "
                                             r"weights were not updated\); the last good checkpoint is .*step-000002"):
            distill(DistillJob(str(teacher), out, str(student), text=text), cfg, progress=False)
        from safetensors.torch import load_file

        weights = load_file(str(out / "checkpoints" / "step-000002" / "student.safetensors"))
        assert all(torch.isfinite(w).all() for w in weights.values())


def test_a_resumed_run_that_diverges_names_the_checkpoint_it_resumed(pair, tmp_path: Path, monkeypatch) -> None:
    teacher, student, text = pair
    import brisk.compress.distill as module

    cfg = dataclasses.replace(CFG, steps=2, checkpoint_every=2, eval_every=100)
    distill(DistillJob(str(teacher), tmp_path / "out", str(student), text=text), cfg, progress=False)
    real = module.distill_loss
    monkeypatch.setattr(module, "distill_loss", lambda *a, **k: real(*a, **k) * float("nan"))
    with pytest.raises(ValueError, match=r"stopped at step 3: a loss of nan .*the last good checkpoint is "
                                         r".*step-000002"):
        distill(DistillJob(str(teacher), tmp_path / "out", str(student), text=text, resume=tmp_path / "out"),
                dataclasses.replace(cfg, steps=6), progress=False)


_FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
import dataclasses
from tests.compress.test_distill import CFG, _trainer
from brisk.compress.distill import write_student
from brisk.errors import UserError

teacher, student, text, out = (Path(a) for a in sys.argv[1:5])
trainer = _trainer((teacher, student, text), out, dataclasses.replace(CFG, steps=3, eval_every=100))
trainer.train_step()
first = trainer.save_checkpoint()
trainer.train_step()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
weights = (first / "student.safetensors").stat().st_size
results = {}
for name, limit in [("safetensors", weights // 2), ("torch.save", weights + 1024)]:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        trainer.save_checkpoint()
        results[name] = "written"
    except UserError as e:
        results[name] = str(e)
    try:
        write_student(trainer, 1.0, 1)
        results[name + " student"] = "written"
    except UserError as e:
        results[name + " student"] = str(e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(json.dumps(results))
"""


def test_a_real_failed_write_is_caught_whatever_the_writer_raises(pair, tmp_path: Path) -> None:
    """A file-size limit makes real writes fail (EFBIG, as a full disk would): safetensors raises its
    own error and torch.save a RuntimeError, not OSError; each is still a clear error that leaves
    no temporary file and keeps the previous checkpoint."""
    import subprocess
    import sys

    teacher, student, text = pair
    out = tmp_path / "out"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(teacher), str(student), str(text), str(out)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("safetensors", "torch.save"):
        assert re.match(r"writing checkpoint .*step-000002 failed \(.+\); nothing half-written was left",
                        results[name]), results
        assert re.match(r"writing the student in .* failed \(.+\); nothing half-written was left: .*--resume",
                        results[name + " student"]), results
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary file or folder
    assert not (out / "model.safetensors").exists() and not (out / "tokenizer.json").exists()


def test_without_held_out_text_the_run_trains_and_says_so(pair, tmp_path: Path, capsys) -> None:
    teacher, student, text = pair
    rc = main(["distill", "--teacher", str(teacher), "--student", str(student), "--out", str(tmp_path / "out"),
               "--text", str(text), "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "0"])
    assert rc == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["eval"] == []
    assert "no held-out evaluation" in captured.err
    assert load_model(str(tmp_path / "out")).config.num_hidden_layers == TINY.num_hidden_layers


def test_on_policy_alone_is_a_flag() -> None:
    from brisk.cli import build_parser

    base = ["distill", "--teacher", "t", "--out", "o"]
    assert build_parser().parse_args(base + ["--on-policy"]).on_policy == 0.5
    assert build_parser().parse_args(base + ["--on-policy", "0.25"]).on_policy == 0.25
    assert build_parser().parse_args(base).on_policy is None  # the preset's (0, or 0.5 with --for-draft)
    assert build_parser().parse_args(base + ["--top-k", "20", "--store-teacher"]).store_teacher


@pytest.mark.cuda
def test_distillation_runs_on_cuda(pair, tmp_path: Path) -> None:
    """The same code on a GPU: teacher and student there, the loss falls, the student is written."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    teacher, student, text = pair
    cfg = dataclasses.replace(CFG, steps=10, eval_every=10, checkpoint_every=10)
    report = distill(DistillJob(str(teacher), tmp_path / "out", str(student), text=text, device="cuda"), cfg,
                     progress=False)
    assert report["eval"][-1]["kl"] < report["eval"][0]["kl"]
    assert load_model(str(tmp_path / "out")).config.num_hidden_layers == TINY.num_hidden_layers


def test_a_student_tokenizing_otherwise_and_too_few_prompts_are_refused(pair, tmp_path: Path) -> None:
    """A student whose vocabulary has the teacher's size but other ids, a prompts file with no
    prompt, and one with a single prompt (nothing left to hold out): each named."""
    import shutil

    from brisk.engine.distill_job import prompts_corpus

    teacher, student, text = pair
    other = tmp_path / "permuted"
    shutil.copytree(student, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {f"w{i}": (7 * i) % VOCAB for i in range(VOCAB)}  # same words, other ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"tokenizer differs from the teacher's \(another tokenization"):
        distill(DistillJob(str(teacher), tmp_path / "a", str(other), text=text), CFG, progress=False)
    t = load_model(str(teacher))
    empty, one = tmp_path / "empty.txt", tmp_path / "one.txt"
    empty.write_text("\n")
    one.write_text("w3 w5\n")
    with pytest.raises(ValueError, match="empty.txt has no prompts"):
        prompts_corpus(str(teacher), t.tokenizer, empty, CFG, None)
    with pytest.raises(ValueError, match="has 1 prompt\\(s\\): give at least 2"):
        prompts_corpus(str(teacher), t.tokenizer, one, CFG, None)


def test_the_teachers_top_k_is_stored_once_by_the_engine_and_replaces_its_forward(pair, tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Forward KL over the top 8: the engine's logprobs at every training position are the loop's
    teacher's own top 8 (same ids, same log-probabilities), a step's loss from them equals the
    loop's, the run learns, and a resumed run reads them from the file instead of running the
    engine again."""
    import brisk.compress.distill as module
    from brisk.compress.distill import fkl_top
    from brisk.compress.distill_data import TOPK_FILE
    from brisk.engine.distill_job import teacher_topk

    teacher, student, text = pair
    from brisk.config import MAX_LOGPROBS
    from brisk.request import SamplingParams

    cfg = dataclasses.replace(CFG, top_k=8, steps=12, eval_every=12, checkpoint_every=6, store_teacher=True)
    assert MAX_LOGPROBS == SamplingParams.MAX_LOGPROBS == 20  # the engine's limit is the stored k's
    for bad in ({"top_k": 32}, {"top_k": 0}, {"loss": "rkl", "top_k": 0}, {"on_policy": 1.0}):
        with pytest.raises(ValueError, match="store_teacher keeps the teacher's top k"):
            dataclasses.replace(cfg, **bad)
    trainer = _trainer(pair, tmp_path / "out", cfg)
    trainer.stored = stored = teacher_topk(str(teacher), trainer.corpus.train, 8, "cpu", tmp_path / "out" / TOPK_FILE)
    assert stored is not None and stored.k == 8 and stored.ids.shape[0] == trainer.corpus.train_tokens
    for i in (0, 5, len(trainer.corpus.train) - 1):
        with torch.no_grad():
            full = F.log_softmax(logits_of(trainer.teacher.model, [trainer.corpus.train[i]]), dim=-1)
        ids, logprobs = stored.rows([i], torch.device("cpu"))
        values, index = full.topk(8, dim=-1)
        assert torch.equal(ids, index)  # every position's top 8, in order
        torch.testing.assert_close(logprobs, values, atol=2e-4, rtol=1e-4)
    seqs = trainer.batch(0)
    with torch.no_grad():
        student_logits = logits_of(trainer.student.model, seqs)
        in_loop = distill_loss("fkl", student_logits, logits_of(trainer.teacher.model, seqs), top_k=8)
        from_file = fkl_top(student_logits, *stored.rows(trainer.indices(0), torch.device("cpu")))
    torch.testing.assert_close(from_file, in_loop, atol=1e-4, rtol=1e-4)
    real_logits, teacher_calls = module.logits_of, []

    def counted(model, seqs):
        teacher_calls.extend([1] if model is trainer.teacher.model else [])
        return real_logits(model, seqs)

    monkeypatch.setattr(module, "logits_of", counted)
    first = trainer.train_step()
    assert teacher_calls == [] and math.isfinite(first)  # a step on the corpus runs no teacher forward
    monkeypatch.setattr(module, "logits_of", real_logits)

    report = distill(DistillJob(str(teacher), tmp_path / "run", str(student), text=text), cfg, progress=False)
    assert report["teacher_top_k"]["k"] == 8 and report["teacher_top_k"]["positions"] == stored.ids.shape[0]
    assert (tmp_path / "run" / TOPK_FILE).is_file()
    assert report["eval"][-1]["kl"] < report["eval"][0]["kl"]

    def no_engine(*args, **kwargs):
        raise AssertionError("the stored top k was computed again")

    monkeypatch.setattr("brisk.engine.distill_job.LLM", no_engine)
    again = distill(DistillJob(str(teacher), tmp_path / "run", str(student), text=text, resume=tmp_path / "run"),
                    dataclasses.replace(cfg, steps=14), progress=False)
    assert again["teacher_top_k"]["engine_seconds"] == 0.0 and again["steps"] == 14


def test_a_pruned_student_keeps_its_pruning_report(pair, tmp_path: Path) -> None:
    """Recovery after pruning: the distilled student's config.json still says how it was cut
    (`eval ppl` compares a pruned model with its source through it), beside how it was trained."""
    from brisk.compress.prune import PRUNING_KEY, prune_to_dir
    from brisk.config import PruneConfig

    teacher, _, text = pair
    pruned = tmp_path / "pruned"
    prune_to_dir(str(teacher), PruneConfig("layers", 0.5, str(text), calibration_tokens=256), pruned)
    cut = json.loads((pruned / "config.json").read_text())[PRUNING_KEY]
    cfg = dataclasses.replace(CFG, steps=2, eval_every=2, checkpoint_every=2)
    distill(DistillJob(str(teacher), tmp_path / "out", str(pruned), text=text), cfg, progress=False)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written[PRUNING_KEY] == cut and written["brisk_distill"]["steps"] == 2
    assert written["num_hidden_layers"] == 2
