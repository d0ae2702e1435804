"""Static pruning on the default model: the cut model equals the dense one with the same heads,
channels or layers masked; a pruned directory reloads bit for bit; decode plan, batching and
quantization run on its non-uniform layers; bad input is refused before any work."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.compress.prune import (
    Calibration,
    Plan,
    calibrate,
    calibration_ids,
    check_prunable,
    layers_plan,
    load_pruned,
    pruned_config,
    slice_tensors,
    structured_plan,
)
from brisk.config import ModelConfig, PruneConfig
from brisk.loader.load import LoadedModel, load_model, read_checkpoint
from brisk.model.attention import ContiguousAttention, SeqSpan
from brisk.model.base import forward_sequence
from brisk.model.registry import build_model

# English text that every checkout has: the calibration text of these tests
CALIBRATION = str(Path(__file__).resolve().parents[2] / "README.md")
TOKENS = 512
PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time, in a small village,", "1, 2, 3, 4,"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _pcfg(method: str, ratio: float, **kw: object) -> PruneConfig:
    return PruneConfig(method, ratio, CALIBRATION, calibration_tokens=TOKENS, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def dense(gguf_path: Path) -> LoadedModel:
    return load_model(str(gguf_path), dequantize=True)


@pytest.fixture(scope="module")
def calibration(dense: LoadedModel) -> Calibration:
    return calibrate(dense.model, calibration_ids(dense.tokenizer, _pcfg("structured", 0.25)))


def _build(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = build_model(cfg, torch.float32, max_positions=512)
    with torch.no_grad():
        model.load_weights(tensors.items())
    return model.eval()


def _hidden_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model.compute_logits(forward_sequence(model, ids))


def _masked_dense(dense: LoadedModel, plan: Plan, cal: Calibration) -> torch.nn.Module:
    """The dense model with the plan's dropped KV groups and channels zeroed in o_proj / down_proj
    and their mean contribution added as a bias: what the cut model must compute."""
    cfg = dataclasses.replace(dense.config, output_bias=True)
    _, _, weights = read_checkpoint(dense.source)
    zeros = {f"layers.{i}.{m}.bias": torch.zeros(cfg.hidden_size) for i in range(cfg.num_hidden_layers)
             for m in ("self_attn.o_proj", "mlp.down_proj")}
    model = _build(cfg, {**dict(weights), **zeros})
    hd, group = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            kept_q = {r for g in plan.kv_groups[i] for r in range(g * group * hd, (g + 1) * group * hd)}
            drop_q = torch.tensor([r for r in range(cfg.q_size) if r not in kept_q], dtype=torch.long)
            kept_c = set(plan.channels[i])
            drop_c = torch.tensor([c for c in range(cfg.intermediate_size) if c not in kept_c], dtype=torch.long)
            for linear, drop, stats in ((layer.self_attn.o_proj, drop_q, cal.attn[i]), (layer.mlp.down_proj, drop_c, cal.mlp[i])):
                w = linear.weight
                linear.bias.copy_((w.double()[:, drop] @ stats.mean[drop]).float())
                w[:, drop] = 0.0
    return model


def test_structured_equals_the_masked_dense_model(dense: LoadedModel, calibration: Calibration) -> None:
    pcfg = _pcfg("structured", 0.25)
    plan = structured_plan(dense.model, calibration, pcfg)
    cfg = dense.config
    assert any(len(plan.kv_groups[i]) < cfg.num_key_value_heads for i in plan.layers)  # heads really go
    assert any(len(plan.channels[i]) < cfg.intermediate_size for i in plan.layers)
    assert all(len(c) % 64 == 0 and len(g) >= 1 for c, g in zip(plan.channels.values(), plan.kv_groups.values()))
    _, _, weights = read_checkpoint(dense.source)
    new_cfg = pruned_config(cfg, plan, bias=True)
    pruned = _build(new_cfg, slice_tensors(cfg, weights, plan, calibration, bias=True))
    removed = 1 - sum(new_cfg.layer_params(i) for i in range(30)) / sum(cfg.layer_params(i) for i in range(30))
    assert abs(removed - 0.25) < 0.02
    ids = dense.tokenizer.encode("The history of the city begins in the Roman era, when a small fort", add_special_tokens=False)
    got, want = _hidden_logits(pruned, ids), _hidden_logits(_masked_dense(dense, plan, calibration), ids)
    assert torch.allclose(got, want, atol=2e-3, rtol=1e-4), float((got - want).abs().max())
    assert not torch.allclose(got, _hidden_logits(dense.model, ids), atol=1e-1)  # the cut changed the model


def test_layers_equals_the_dense_model_skipping_them(dense: LoadedModel, calibration: Calibration) -> None:
    plan = layers_plan(calibration, _pcfg("layers", 0.2))
    assert len(plan.layers) == 24 and plan.layers == sorted(plan.layers)
    dropped = set(range(30)) - set(plan.layers)
    # the dropped layers are those whose output is most like their input
    assert max(calibration.influence[i] for i in dropped) <= min(calibration.influence[i] for i in plan.layers)
    _, _, weights = read_checkpoint(dense.source)
    pruned = _build(pruned_config(dense.config, plan, bias=False), slice_tensors(dense.config, weights, plan, None, False))
    ids = dense.tokenizer.encode("A short sentence about rivers and the sea.", add_special_tokens=False)
    assert torch.equal(_hidden_logits(pruned, ids), _skipping(dense.model, ids, plan.layers))


@torch.inference_mode()
def _skipping(model: torch.nn.Module, ids: list[int], layers: list[int]) -> torch.Tensor:
    """Logits of the dense model running only `layers` (each with its own cache slot)."""
    cfg, n = model.config, len(ids)
    shape = (1, cfg.num_key_value_heads, n, cfg.head_dim)
    caches = [(torch.empty(shape), torch.empty(shape)) for _ in range(cfg.num_hidden_layers)]
    attn = ContiguousAttention(caches, [SeqSpan(0, 0, n, 0)], scale=cfg.attn_scale)
    ropes = model.step_ropes(torch.arange(n))
    h, residual = model.embed(torch.tensor(ids)), None
    for i in layers:
        h, residual = model.layers[i](h, residual, ropes, attn)
    return model.compute_logits(model.final_norm(h, residual))


@pytest.fixture(scope="module")
def pruned_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pruned") / "smollm2-structured"
    result = subprocess.run([sys.executable, "-m", "brisk.cli", "prune", str(gguf_path), "--method", "structured",
                             "--ratio", "0.25", "--calibration", CALIBRATION, "--calibration-tokens", str(TOKENS),
                             "--out", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["method"] == "structured" and report["params"] < report["params_dense"]
    return out


def test_pruned_directory_reloads_bit_identically(gguf_path: Path, pruned_dir: Path) -> None:
    """`brisk prune` + `--model DIR` and `LLM(pruning=...)` give the same model, to the bit."""
    from_dir = load_model(str(pruned_dir))
    at_load, report = load_pruned(str(gguf_path), _pcfg("structured", 0.25))
    assert from_dir.config == at_load.config and not from_dir.config.uniform
    a, b = from_dir.model.state_dict(), at_load.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((pruned_dir / "config.json").read_text())["brisk_pruning"]["kv_heads"] == report["kv_heads"]


def test_pruned_model_decodes_through_the_plan_batched_and_alone(pruned_dir: Path) -> None:
    """Non-uniform layers in the C++ decode plan give the module path's tokens; a batch gives
    each prompt its tokens alone."""
    llm = LLM(str(pruned_dir), num_kv_blocks=64, max_model_len=256)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert llm.engine.runner.plans.current is not None  # the plan served the decode steps
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone
    eager = LLM(str(pruned_dir), num_kv_blocks=64, max_model_len=256, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)] == batched


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_pruned_model_quantizes(pruned_dir: Path, method: str) -> None:
    """The MLP widths are multiples of 64: int4's groups fit every down_proj."""
    llm = LLM(str(pruned_dir), num_kv_blocks=64, max_model_len=256, quantization=method,
              quantization_config={"calibration": "none"} if method == "int4" else None)  # GPTQ: minutes
    out = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)


@pytest.mark.parametrize(("options", "message"), [
    ({"method": "structured", "ratio": 0.0, "calibration": CALIBRATION}, "strictly between 0 and 1"),
    ({"method": "structured", "ratio": 1.2, "calibration": CALIBRATION}, "strictly between 0 and 1"),
    ({"method": "structured", "ratio": 0.3}, "calibration"),
    ({"method": "heads", "ratio": 0.3, "calibration": CALIBRATION}, "unknown pruning method"),
    ({"method": "layers", "ratio": 0.3, "calibration": CALIBRATION, "window": 3}, "unknown pruning option"),
    ({"method": "structured", "ratio": 0.3, "calibration": CALIBRATION, "multiple": 48}, "power of two"),
])
def test_bad_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PruneConfig.parse(options)


def test_ratios_a_model_cannot_take_are_refused_before_loading(gguf_path: Path) -> None:
    from brisk.loader.load import model_config_of

    cfg = model_config_of(str(gguf_path))
    with pytest.raises(ValueError, match="removes 0"):
        check_prunable(cfg, _pcfg("layers", 0.01))
    with pytest.raises(ValueError, match="no attention head or no MLP channel"):
        check_prunable(cfg, _pcfg("structured", 0.95))
    with pytest.raises(ValueError, match="fewer than the multiple"):
        check_prunable(cfg, _pcfg("structured", 0.3, multiple=2048))


def test_short_calibration_text_is_refused(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("Too short to score anything.")
    with pytest.raises(ValueError, match="at least 256"):
        LLM("smollm2-135m", pruning={"method": "layers", "ratio": 0.2, "calibration": str(short)})
    with pytest.raises(ValueError, match="not a file"):
        LLM("smollm2-135m", pruning={"method": "layers", "ratio": 0.2, "calibration": str(tmp_path / "none.txt")})


@pytest.fixture(scope="module")
def sparse_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from brisk.compress.prune import prune_to_dir

    out = tmp_path_factory.mktemp("pruned") / "smollm2-2-4"
    report = prune_to_dir(str(gguf_path), _pcfg("2:4", 0.5), out)
    assert report["layer_weights_removed"] == 0.5 and report["values"] == "2:4 float32 sparsegpt"
    return out


def test_2_4_directory_decodes_through_the_plan(sparse_dir: Path) -> None:
    from brisk.quant.sparse24 import Sparse24Linear

    llm = LLM(str(sparse_dir), num_kv_blocks=64, max_model_len=256)
    assert isinstance(llm.model.layers[0].mlp.down_proj, Sparse24Linear)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert llm.engine.runner.plans.current is not None
    assert batched == [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    eager = LLM(str(sparse_dir), num_kv_blocks=64, max_model_len=256, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)] == batched


# ~44 s on an AVX2-only CPU (a second SparseGPT pass): a slow check. The pass itself is the one
# the directory above was written with (compress/prune.py), tested in CI through that directory.
@pytest.mark.slow
def test_2_4_at_load_equals_the_directory(gguf_path: Path, sparse_dir: Path) -> None:
    llm = LLM(str(sparse_dir), num_kv_blocks=64, max_model_len=256)
    at_load = LLM(str(gguf_path), num_kv_blocks=64, max_model_len=256,
                  pruning={"method": "2:4", "calibration": CALIBRATION, "calibration_tokens": TOKENS})
    a, b = llm.model.state_dict(), at_load.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert at_load.pruning is not None and at_load.pruning["method"] == "2:4"


# ~27 s (a SparseGPT pass of its own): a slow check; int8 2:4 modules are checked against their
# dense masked weight in tests/quant/test_sparse24.py, every ISA.
@pytest.mark.slow
def test_2_4_with_int8_values(gguf_path: Path) -> None:
    from brisk.quant.int8 import Int8Linear
    from brisk.quant.sparse24 import Sparse24Linear

    llm = LLM(str(gguf_path), num_kv_blocks=64, max_model_len=256, quantization="int8",
              pruning={"method": "2:4", "calibration": CALIBRATION, "calibration_tokens": TOKENS})
    down = llm.model.layers[0].mlp.down_proj
    assert isinstance(down, Sparse24Linear) and down.int8 and isinstance(llm.model.lm_head, Int8Linear)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert llm.engine.runner.plans.current is not None
    assert batched == [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    with pytest.raises(ValueError, match="cannot combine with int4"):
        LLM(str(gguf_path), quantization="int4", pruning={"method": "2:4", "calibration": CALIBRATION})
    with pytest.raises(ValueError, match="its ratio is 0.5"):
        PruneConfig("2:4", 0.3, CALIBRATION)
