"""The C++ decode plan (runtime/decode_plan.py, held by the runner) computes exactly what the module path computes: the
same tokens and the same log-probabilities, bit for bit, for every Linear kind it serves; models it
cannot serve keep the module path; anything that may change the modules drops the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.runtime.decode_plan import plan_supported
from brisk.quant import set_activations

pytestmark = pytest.mark.skipif(not plan_supported(), reason="needs the AVX-512 kernels")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def _outputs(llm: LLM, use_plan: bool) -> list[tuple[list[int], list[tuple[float, tuple]]]]:
    llm.engine.runner.plans.enabled = use_plan
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    result = []
    for out in outs:
        c = out.outputs[0]
        assert c.logprobs is not None
        result.append((c.token_ids, [(step.logprob, step.top) for step in c.logprobs]))
    return result


# int4 and w8a8 calibrate on the model's own text by default (minutes): these tests are about the
# kernels and the plan, which round-to-nearest weights exercise alike (g64: the default model's Q4_1
# grid would otherwise be kept at g32, the gguf rows' weights)
RTN = {"calibration": "none", "group_size": 64}


@pytest.mark.parametrize("quantization,config", [("float", None), ("int4", RTN), ("int4", {**RTN, "activations": "int8"}),
                                                 ("int4", {**RTN, "activations": "int16"}), ("int8", None), ("gguf", None),
                                                 ("gguf", {"activations": "int8"})])
def test_plan_gives_the_module_path_numbers_bit_for_bit(quantization: str, config: dict | None,
                                                        gguf_path: Path) -> None:
    float_model = quantization == "float"  # the file dequantized; the others quantize it or keep its blocks
    llm = LLM("smollm2-135m", quantization=None if float_model else quantization, quantization_config=config,
              max_model_len=256, num_kv_blocks=64, dequantize=float_model)
    with_plan = _outputs(llm, True)
    assert llm.engine.runner.plans.current, "the plan should serve this model"
    assert with_plan == _outputs(llm, False)


@pytest.mark.parametrize("quantization", ["gguf", "int4", "int8"])
def test_a_full_batch_runs_on_the_plan_with_the_module_path_numbers(quantization: str, gguf_path: Path) -> None:
    """Past 8 rows the quantized Linears' modules call the same kernels (up to their `plan_rows`), so
    the plan serves a batch of 12 requests' decode steps too, with the module path's numbers; the
    float model's plan stays at 8 rows (its modules take oneDNN's GEMM past small_gemm)."""
    from brisk.runtime.decode_plan import PLAN_ROWS_CAP

    llm = LLM("smollm2-135m", quantization=quantization, quantization_config=RTN if quantization == "int4" else None,
              max_model_len=256, num_kv_blocks=128)
    prompts = [f"{p} ({i})" for i in range(4) for p in PROMPTS]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    runs = llm.engine.runner.plans

    def outputs(use_plan: bool) -> list:
        runs.enabled = use_plan
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [(s.logprob, s.top) for s in o.outputs[0].logprobs]) for o in outs]

    calls = []
    plan_run = type(runs)._for_step

    def counting(self, h, attn):  # the plan's steps by their rows
        plan = plan_run(self, h, attn)
        calls.append((h.shape[0], plan is not None))
        return plan

    type(runs)._for_step = counting
    try:
        with_plan = outputs(True)
    finally:
        type(runs)._for_step = plan_run
    assert runs.current.max_rows() == PLAN_ROWS_CAP
    assert (12, True) in calls, "a 12-row decode step should run on the plan"
    assert with_plan == outputs(False)
    dense = LLM("smollm2-135m", dequantize=True, max_model_len=256, num_kv_blocks=128)
    dense.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert dense.engine.runner.plans.current.max_rows() == 8


def test_models_without_kernels_keep_the_module_path(gguf_path: Path) -> None:
    llm = LLM("smollm2-135m", quantization="w8a8", quantization_config=RTN, max_model_len=256, num_kv_blocks=64)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.runner.plans.refused  # W8A8 Linears have no single-kernel op in the plan


def test_enforce_eager_keeps_the_module_path(gguf_path: Path) -> None:
    llm = LLM("smollm2-135m", enforce_eager=True, max_model_len=256, num_kv_blocks=64)
    llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    plans = llm.engine.runner.plans
    assert plans.current is None and not plans.refused and not plans.enabled


def test_changing_the_modules_drops_the_plan(gguf_path: Path) -> None:
    llm = LLM("smollm2-135m", quantization="int4", quantization_config=RTN, max_model_len=256, num_kv_blocks=64)
    plans = llm.engine.runner.plans
    before = _outputs(llm, True)
    assert plans.current
    set_activations(llm.model, "int8")  # the plan had captured int16 activations (the default)
    assert plans.current is None
    after = _outputs(llm, True)
    assert plans.current and after != before
    llm.model.to(torch.float32)  # .to() may move or retype the weights: the plan goes
    assert plans.current is None


def test_plan_numbers_do_not_depend_on_the_thread_count(gguf_path: Path) -> None:
    """A step is one parallel region whose threads split every Linear's rows and attention's items;
    with one thread the same loop runs alone. Every row is computed the same way by whichever
    thread owns it, so one and two threads give the module path's numbers alike."""
    llm = LLM("smollm2-135m", quantization="int4", quantization_config=RTN, max_model_len=256, num_kv_blocks=64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _outputs(llm, True)
        torch.set_num_threads(2)
        two = _outputs(llm, True)
    finally:
        torch.set_num_threads(threads)
    assert one == two == _outputs(llm, False)


def test_plan_rejects_bad_inputs_with_clear_errors(gguf_path: Path) -> None:
    llm = LLM("smollm2-135m", max_model_len=256, num_kv_blocks=64)
    llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    plan = llm.engine.runner.plans.current
    assert plan
    cfg = llm.model.config
    h = torch.zeros(1, cfg.hidden_size)
    cos = sin = [torch.zeros(1, cfg.head_dim)]  # one rotary table (Gemma 3 has two)
    k = torch.zeros(4, cfg.num_key_value_heads, cfg.head_dim, 16)
    v = torch.zeros(4, cfg.num_key_value_heads, 16, cfg.head_dim)
    tables, starts, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), \
        torch.ones(1, dtype=torch.int32)
    slot = torch.zeros(1, dtype=torch.long)

    def run(**over: object) -> object:
        args = {"h": h, "residual": None, "cos": cos, "sin": sin, "caches": [k, v], "slot_blocks": [slot],
                "slot_offsets": slot, "block_tables": [tables], "query_start": starts, "kv_lens": lens,
                "scale": 0.125, "start": 0, "end": 1}
        args.update(over)
        return plan.run(**args)

    out, res = run()  # the well-formed call works
    assert out.shape == res.shape == h.shape and torch.isfinite(out).all()
    with pytest.raises(RuntimeError, match="outside the cache"):
        run(slot_blocks=[torch.tensor([9])])
    with pytest.raises(RuntimeError, match="caches must be contiguous float32"):
        run(caches=[v, k])
    with pytest.raises(RuntimeError, match="kv length does not fit the block table"):
        run(kv_lens=torch.tensor([40], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="one slot_blocks and one block_tables per KV group"):
        run(block_tables=[tables, tables])
    with pytest.raises(RuntimeError, match="is in KV group 1 of 1"):
        run(layer_group=[1] * cfg.num_hidden_layers)
    with pytest.raises(RuntimeError, match="are not in the plan"):
        run(start=0, end=cfg.num_hidden_layers + 1)
    with pytest.raises(RuntimeError, match="h must be a contiguous float32"):
        run(h=torch.zeros(1, cfg.hidden_size + 1))
    most = plan.max_rows()
    with pytest.raises(RuntimeError, match=f"the plan serves 1 to {most}"):
        run(h=torch.zeros(most + 1, cfg.hidden_size))
    with pytest.raises(RuntimeError, match="cos and sin come in pairs"):
        run(cos=[], sin=[])


def test_adapters_in_the_plan_add_what_the_module_hooks_add(gguf_path: Path) -> None:
    """Speculative Streaming's stream pass: the plan with low-rank adapters on the top layers'
    Linears (gguf block kernels underneath) gives the module path's rows with its forward hooks."""
    from brisk.core.outputs import ScheduledRequest
    from brisk.speculative.base import DraftRequest
    from brisk.speculative.streaming import StreamAdapter, StreamingProposer

    llm = LLM("smollm2-135m", max_model_len=256, num_kv_blocks=64)
    model, runner = llm.model, llm.engine.runner
    torch.manual_seed(0)
    adapter = StreamAdapter(model.config, num_streams=4, num_layers=3, rank=8)
    with torch.no_grad():
        for p in adapter.parameters():
            p.normal_(0, 0.05)
    proposer = StreamingProposer(model, adapter.eval(), runner)
    ids = llm.get_tokenizer().encode("The lighthouse at Point Arden was built in 1872 from granite")
    table = [[0, 1]]  # 32 slots: the prompt, t_last and 4 draft slots
    p = len(ids) - 1
    runner.capture_layer = adapter.first_layer  # the prompt's KV, and the residual stream of its last row
    start = runner.execute([ScheduledRequest("r", ids[:p], 0, table, sample=True)]).captured
    assert start is not None
    proposer.observe("r", start[0], p - 1)
    request = DraftRequest("r", ids, 4, table, SamplingParams(temperature=0.0), None)
    rows = {}
    for planned in (True, False):
        proposer.plans.enabled = planned
        rows[planned] = proposer.stream_hidden([request], [4])
    assert proposer.plans.current is not None  # built while enabled
    # the same floats but for the adapters' rounding (summed in another order), carried through 3 layers
    # whose block kernels round activations to int8 (a last-bit change can move a quantum): 4e-5 measured
    err = (rows[True] - rows[False]).norm() / rows[False].norm()
    assert err < 1e-3, err
    with torch.no_grad():
        for key in adapter.lora_b:
            adapter.lora_b[key].zero_()  # adapters that add exactly zero: the module path's bits
    proposer.plans = runner.adapted_plans(adapter.plan_adapters(), lambda: adapter.active(model))
    for planned in (True, False):
        proposer.plans.enabled = planned
        rows[planned] = proposer.stream_hidden([request], [4])
    assert torch.equal(rows[True], rows[False])
    plan = proposer.plans.current
    a, b = adapter.plan_adapters()[(model.config.num_hidden_layers - 1, 1)]
    with pytest.raises(RuntimeError, match="set_lora names layer"):
        plan.set_lora(model.config.num_hidden_layers, 0, a, b)
    with pytest.raises(RuntimeError, match="an adapter for a 576 x 576 Linear"):
        plan.set_lora(0, 1, torch.zeros(8, 7), b)
    with pytest.raises(RuntimeError, match="needs both a and b"):
        plan.set_lora(0, 1, a, None)
