"""`brisk eval ppl`: perplexity on a text, and how far a model variant drifts from the reference.

The text is tokenized once and cut into non-overlapping windows of `window` tokens; each window
is scored on every token after its first (the first has no context inside the window), so the
figure does not depend on the batch layout and matches the usual "stride = window" evaluation.
When the model under test is not the float32 reference (another dtype; quantized models with
issue 5), the float32 model scores the same windows and each position adds
KL(p_reference || p_model) and whether both put the same token on top.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from brisk.engine.llm import LLM
from brisk.errors import UserError
from brisk.loader.load import load_model
from brisk.model.base import CausalLM, forward_sequence
from brisk.request import SamplingParams
from brisk.runtime.model_runner import sdpa_context

LOGIT_ROWS = 256  # positions turned into vocab-wide log-probs at a time (bounds memory)


@dataclass
class WindowScore:
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    top1_agree: int = 0
    tokens: int = 0


def read_tokens(llm: LLM, path: Path, max_tokens: int | None) -> list[int]:
    text = path.read_text(encoding="utf-8", errors="replace")
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    return ids[:max_tokens] if max_tokens else ids


@torch.inference_mode()
def _hidden(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """Final hidden states of every position of one window: [n, hidden]."""
    with sdpa_context(model.device):
        return forward_sequence(model, ids)


@torch.inference_mode()
def score_window(model: CausalLM, ids: list[int], reference: CausalLM | None,
                 hidden: torch.Tensor | None = None, score_from: int = 1) -> WindowScore:
    """NLL of tokens `score_from`.. given the ones before, plus KL and top-1 agreement against
    `reference`. `hidden`: the window's final hidden states when something other than `model`'s
    forward made them (Probe Pruning's decision pass)."""
    h = _hidden(model, ids) if hidden is None else hidden
    h_ref = _hidden(reference, ids) if reference is not None else None
    targets = torch.tensor(ids[1:], device=h.device)
    score = WindowScore(tokens=len(ids) - score_from)
    for start in range(score_from - 1, len(ids) - 1, LOGIT_ROWS):
        rows = slice(start, min(start + LOGIT_ROWS, len(ids) - 1))
        logp = F.log_softmax(model.compute_logits(h[rows]), dim=-1)  # [r, vocab] float32
        score.nll_sum -= float(logp.gather(-1, targets[rows, None]).sum())
        if h_ref is not None:
            ref_logp = F.log_softmax(reference.compute_logits(h_ref[rows]), dim=-1)  # type: ignore[union-attr]
            score.kl_sum += float((ref_logp.exp() * (ref_logp - logp)).sum())
            score.top1_agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
    return score


def _decode_tokens_per_s(llm: LLM, new_tokens: int = 64) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate("The history of", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    out = llm.generate("The history of", params, use_tqdm=False)[0]
    return round(out.decode_tokens_per_second() or float("nan"), 2)


def weight_bytes(model: CausalLM) -> int:
    """Parameters and quantized buffers (int8 weights, scales); not the rotary tables."""
    tensors = [*model.parameters(), *(b for name, b in model.named_buffers() if not name.startswith("rope_"))]
    return sum(t.numel() * t.element_size() for t in tensors)


def eval_ppl(model_ref: str, dtype: str, text: Path, window: int, max_tokens: int | None,
             quant: dict[str, Any] | None = None, device: str = "cpu", score_from: int = 1) -> dict[str, Any]:
    _check_args(text, window, score_from)
    started = time.perf_counter()
    llm = LLM(model_ref, dtype=dtype, max_model_len=max(window, 256), num_kv_blocks=96,  # KV only for the decode timing
              device=device, **(quant or {}))
    load_seconds = time.perf_counter() - started
    from brisk.compress.prune import model_params, pruning_of
    from brisk.loader.quantized import quantization_of

    if quantization_of(Path(model_ref)) is not None:
        raise UserError(f"{model_ref} is a quantized checkpoint: evaluate the original model with -q METHOD "
                         "so the float32 reference it is compared with is the unquantized one")
    ids = read_tokens(llm, text, max_tokens)
    if len(ids) < 2:
        raise UserError(f"{text} holds fewer than 2 tokens; nothing to score")
    pruning = llm.pruning or pruning_of(Path(model_ref))  # pruned at load, or a `brisk prune` directory
    if pruning is not None and llm.pruning is None:
        pruning = {**pruning, "directory": True}
    probe = llm._probe if llm._probe is not None and llm._probe.active else None
    reference = _reference(llm, model_ref, dtype, device, window, pruning, probe)
    start = time.perf_counter()
    total, probe_seconds = _score(llm, ids, window, score_from, reference, probe)
    elapsed = time.perf_counter() - start
    decode = _decode_tokens_per_s(llm)  # under Probe Pruning llm.model is then the compact model it decided
    result: dict[str, Any] = {
        "bench": "ppl", "model": model_ref, "dtype": dtype, "device": device, "quantization": llm.quantization.describe() if llm.quantization else None, "text": str(text),
        "window": window, "score_from": score_from,
        "tokens_scored": total.tokens, "perplexity": round(math.exp(total.nll_sum / total.tokens), 4),
        "nll_per_token": round(total.nll_sum / total.tokens, 5),
        "kl_vs_float32": round(total.kl_sum / total.tokens, 6) + 0.0 if reference is not None else 0.0,
        "top1_agreement_vs_float32": round(total.top1_agree / total.tokens, 5) if reference is not None else 1.0,
        "weight_mib": round(weight_bytes(llm.model) / 2**20, 1),
        "params": pruning["params"] if pruning is not None else model_params(llm.model_config),  # 2:4: nonzero
        "pruning": None if pruning is None else _pruning_report(pruning, probe is not None, score_from, load_seconds,
                                                                probe_seconds),
        "scoring_tokens_per_s": round(total.tokens / elapsed, 1),
        "decode_tokens_per_s": decode,
    }
    if probe is not None:  # what generation's decision (on the prompt) cost, beside the decode figure;
        # the dense model stays loaded beside the compact one (the decisions run on it)
        result["pruning"]["generate_decision_seconds"] = round(llm.last_probe.seconds, 4)  # type: ignore[index,union-attr]
        result["pruning"]["dense_weight_mib"] = round(weight_bytes(reference) / 2**20, 1)  # type: ignore[arg-type]
    return result


def _check_args(text: Path, window: int, score_from: int) -> None:
    if window < 2:
        raise UserError(f"--window must be >= 2 tokens, got {window}")
    if not 1 <= score_from < window:
        raise UserError(f"--score-from must be a position inside the window (1 to {window - 1}), got {score_from}")
    if not text.is_file():
        raise UserError(f"--text {text} is not a file")


def _reference(llm: LLM, model_ref: str, dtype: str, device: str, window: int, pruning: dict[str, Any] | None,
               probe: Any) -> CausalLM | None:
    """The float32 model the scores are compared with; None when the model scored is that already."""
    if probe is not None:
        return llm._dense_model
    if dtype == "float32" and llm.quantization is None and pruning is None:
        return None
    # a .gguf's blocks as floats: the exactness reference; a pruned model's is the model it was cut from
    dense_ref = pruning.get("source", model_ref) if pruning is not None else model_ref
    reference = load_model(dense_ref, dtype="float32", device=device, max_model_len=max(window, 256),
                           dequantize=True).model
    reference.pack_weights()
    return reference


def _score(llm: LLM, ids: list[int], window: int, score_from: int, reference: CausalLM | None,
           probe: Any) -> tuple[WindowScore, float]:
    """Every window of `ids` scored (and its KL / top-1 against `reference`); with Probe Pruning,
    the seconds its decisions took."""
    total = WindowScore()
    probe_seconds = 0.0
    compact = None
    for i in range(0, len(ids) - 1, window):
        chunk = ids[i:i + window]
        if len(chunk) <= score_from:
            break
        if probe is not None and score_from > 1:  # decided on the window's context part, as on a prompt
            started_decision = time.perf_counter()
            with sdpa_context(reference.device):  # type: ignore[union-attr]
                compact = probe.compact_model(probe.decide([chunk[:score_from]]).plan, reuse=compact)
            probe_seconds += time.perf_counter() - started_decision
            s = score_window(compact, chunk, reference, score_from=score_from)
        elif probe is not None:  # each window is the batch whose probe decides its channels (the paper's protocol)
            with sdpa_context(reference.device):  # type: ignore[union-attr]
                hidden, decision = probe.forward([chunk])
            probe_seconds += decision.seconds
            s = score_window(reference, chunk, reference, hidden)  # type: ignore[arg-type]
        else:
            s = score_window(llm.model, chunk, reference, score_from=score_from)
        total.nll_sum += s.nll_sum
        total.kl_sum += s.kl_sum
        total.top1_agree += s.top1_agree
        total.tokens += s.tokens
    return total, probe_seconds


def _pruning_report(pruning: dict[str, Any], probe: bool, score_from: int, load_seconds: float,
                    probe_seconds: float) -> dict[str, Any]:
    """The result's "pruning" entry: what was cut, and for Probe Pruning how windows were decided."""
    report = {"method": pruning["method"], "ratio": pruning["ratio"],
              "layer_weights_removed": pruning["layer_weights_removed"], "params_dense": pruning["params_dense"],
              "seconds": pruning["seconds"], "load_seconds": round(load_seconds, 2)}
    if probe:
        report.update({"dense_layers": pruning["dense_layers"], "layer_ratio": pruning["layer_ratio"],
                       "probe_tokens": pruning["probe_tokens"], "probe_sequences": pruning["probe_sequences"],
                       "decision": "per window: each window is the batch whose probe decides its heads and channels"
                       if score_from == 1 else f"per window, on its first {score_from} tokens (not scored)",
                       "decision_seconds": round(probe_seconds, 2)})
    return report
