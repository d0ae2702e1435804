"""`brisk` CLI: a streamed reply with a figures line, and one clear line + exit 2 for bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from brisk.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _write_gguf(path: Path, arch: str, tensor_type: gguf.GGMLQuantizationType | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if tensor_type is not None:
        _, nbytes = gguf.GGML_QUANT_SIZES[tensor_type]
        w.add_tensor("token_embd.weight", np.zeros((4, nbytes), dtype=np.uint8),
                     raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_generate_streams_and_ends_with_figures(gguf_path, capsys) -> None:
    code, out, err = _run(capsys, "generate", "--chat", "--prompt", "Name a colour.", "--max-tokens", "12")
    assert code == 0
    assert out.strip()
    figures = err.strip().splitlines()[-1]
    for label in ("prompt", "generated", "time to first token", "decode", "tokens/s"):
        assert label in figures


def test_generate_structured_options(gguf_path, capsys, tmp_path) -> None:
    pytest.importorskip("llguidance")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    code, out, _ = _run(capsys, "generate", "--prompt", "JSON:", "--json-schema", str(schema), "--max-tokens", "20")
    assert code == 0 and isinstance(json.loads(out.strip())["ok"], bool)
    code, out, _ = _run(capsys, "generate", "--prompt", "Pick:", "--choice", "red", "--choice", "blue")
    assert code == 0 and out.strip() in ("red", "blue")
    code, _, err = _run(capsys, "generate", "--prompt", "x", "--regex", "((")
    assert code == 2 and "unclosed group" in err


def test_bench_latency_prints_json(gguf_path, capsys) -> None:
    code, out, _ = _run(capsys, "bench", "latency", "--new-tokens", "4", "--repeats", "1")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["brisk"]["decode_tok_s"] > 0 and result["prompt_tokens"] > 0


def test_bench_latency_interleaves_a_plain_engine(gguf_path, capsys) -> None:
    """`--compare plain`: the quantized engine beside the same model unquantized, runs interleaved."""
    code, out, _ = _run(capsys, "bench", "latency", "-q", "int8", "--compare", "plain", "--new-tokens", "4",
                        "--repeats", "2")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["quantization"].startswith("int8") and result["plain"]["decode_tok_s"] > 0
    ratio = result["brisk"]["decode_tok_s"] / result["plain"]["decode_tok_s"]
    assert abs(result["decode_speedup_vs_plain"] - ratio) < 0.01 and isinstance(result["same_tokens_as_plain"], bool)
    code, _, err = _run(capsys, "bench", "latency", "--compare", "vllm")
    assert code == 2 and "available: hf, llamacpp, plain" in err


def test_bench_throughput_rounds_alternate_with_the_peer(gguf_path, capsys, monkeypatch) -> None:
    """`--rounds 2`: brisk (and llama.cpp where its venv is set) twice on the same workload, brisk's
    prefix cache emptied before each round (no hits: the prompts are computed again); the median
    round's figures, the median of the rounds' ratios."""
    args = ["bench", "throughput", "--num-prompts", "2", "--input-len", "40", "--output-len", "3", "--rounds", "2"]
    from brisk.bench import throughput

    hit_rates: list[float] = []  # the engine's cumulative prefix hit rate after each brisk round
    real_run = throughput.run_brisk
    monkeypatch.setattr(throughput, "run_brisk",
                        lambda llm, work: hit_rates.append((r := real_run(llm, work))["prefix_hit_rate"]) or r)
    peer = os.environ.get("BRISK_LLAMACPP_PYTHON")
    if peer and os.path.isfile(peer):
        args += ["--compare", "llamacpp", "--llamacpp-python", peer]
    code, out, _ = _run(capsys, *args)
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    runs = result["brisk"]["output_tokens_per_s_rounds"]
    assert result["rounds"] == 2 and len(runs) == 2 and result["brisk"]["output_tokens_per_s"] == min(runs)
    assert hit_rates[-2:] == [0.0, 0.0]  # 40-token prompts: two full blocks each, never found again
    if "llamacpp" in result:
        ratios = result["round_speedups_vs_llamacpp"]
        # the median of two ratios is their mean, rounded to 3 decimals as the ratios are
        assert len(ratios) == 2 and result["output_speedup_vs_llamacpp"] == pytest.approx(sum(ratios) / 2, abs=1e-3)
    code, _, err = _run(capsys, "bench", "throughput", "--rounds", "0")
    assert code == 2 and "--rounds must be >= 1" in err


def test_missing_model_path(capsys) -> None:
    code, _, err = _run(capsys, "generate", "--model", "/no/such/model.gguf", "--prompt", "hi")
    assert code == 2 and "not found" in err and "Traceback" not in err


def test_unknown_builtin_name_lists_the_known_ones(capsys) -> None:
    code, _, err = _run(capsys, "generate", "--model", "gpt-17", "--prompt", "hi")
    assert code == 2 and "smollm2-135m" in err


def test_non_gguf_file(tmp_path, capsys) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    code, _, err = _run(capsys, "generate", "--model", str(f), "--prompt", "hi")
    assert code == 2 and "not a .gguf" in err


def test_corrupt_gguf(tmp_path, capsys) -> None:
    f = tmp_path / "garbage.gguf"
    f.write_bytes(os.urandom(4096))
    code, _, err = _run(capsys, "generate", "--model", str(f), "--prompt", "hi")
    assert code == 2 and "not a readable GGUF" in err


def test_truncated_gguf(gguf_path, tmp_path, capsys) -> None:
    f = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as src:
        f.write_bytes(src.read(8 * 1024 * 1024))
    code, _, err = _run(capsys, "generate", "--model", str(f), "--prompt", "hi")
    assert code == 2 and ("truncated" in err or "not a readable GGUF" in err)


def test_unsupported_architecture(tmp_path, capsys) -> None:
    f = _write_gguf(tmp_path / "bert.gguf", "bert")
    code, _, err = _run(capsys, "generate", "--model", str(f), "--prompt", "hi")
    assert code == 2 and "'bert' is not supported" in err and "llama" in err


def test_unsupported_tensor_type(tmp_path, capsys) -> None:
    f = _write_gguf(tmp_path / "q81.gguf", "llama", gguf.GGMLQuantizationType.Q8_1)
    code, _, err = _run(capsys, "generate", "--model", str(f), "--prompt", "hi")
    assert code == 2 and "Q8_1" in err and "Q4_K" in err


def test_hf_directory_missing_files(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert code == 2 and "tokenizer.json" in err and "*.safetensors" in err


@pytest.mark.parametrize("args, match", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--top-p", "0"], "top_p"),
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
])
def test_bad_generation_values(args: list[str], match: str, capsys) -> None:
    code, _, err = _run(capsys, "generate", *args)
    assert code == 2 and match in err


def test_prompt_longer_than_context(gguf_path, capsys) -> None:
    code, _, err = _run(capsys, "generate", "--max-model-len", "16", "--prompt", "word " * 40)
    assert code == 2 and "context window is 16" in err


def test_usage_error_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate"])  # --prompt is required
    assert exc.value.code == 2


@pytest.mark.parametrize("argv, match", [
    (["generate", "--prompt", "hi", "--speculative-config", "{method: ngram}"], "not valid JSON"),
    (["generate", "--prompt", "hi", "--speculative-config", '{"method": "lookahead"}'], "unknown speculative method"),
    (["bench", "spec", "--methods", "medusa"], "--medusa-heads"),
    (["bench", "spec", "--methods", "ngram", "--workloads", "poetry"], "unknown workload"),
    (["bench", "spec", "--methods", "ngram", "--draft", "d1={model: x}"], "after NAME= comes a JSON object"),
    (["bench", "spec", "--methods", "ngram", "--draft", "ngram={}"], "a new name"),
    (["bench", "spec", "--methods", "ngram", "--draft", 'v={"model": "m", "draft_vocab": 0}'], "draft_vocab"),
    (["train-heads", "--kind", "medusa", "--out", "x.safetensors", "--num-heads", "0"], "--num-heads >= 1"),
    (["train-heads", "--kind", "streaming", "--out", "x.safetensors", "--lora-rank", "0"], "--lora-rank 1..256"),
    (["train-heads", "--kind", "medusa", "--out", "x.safetensors", "--init", "s.safetensors"], "applies to --kind streaming"),
    (["bench", "spec", "--methods", "streaming"], "--streaming-heads"),
])
def test_speculative_options_are_checked_before_loading(argv: list[str], match: str, capsys) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2 and match in err


def test_bench_spec_prints_json(gguf_path, capsys) -> None:
    code, out, _ = _run(capsys, "bench", "spec", "--methods", "ngram", "--workloads", "open_chat",
                        "--max-tokens", "6", "--num-speculative-tokens", "3")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    ngram = result["workloads"]["open_chat"]["methods"]["ngram"]
    assert ngram["identical_to_plain"] is True and ngram["tokens_per_s"] > 0
    assert result["workloads"]["open_chat"]["plain_tokens_per_s"] > 0


def test_bench_kv_prints_both_layouts_side_by_side(gguf_path, capsys) -> None:
    code, out, _ = _run(capsys, "bench", "kv", "--batches", "2", "--contexts", "40", "--decode-tokens", "4",
                        "--kv-cache-memory-gib", "0.25")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    cell = result["cells"][0]
    from brisk.runtime.virtual_kv import residency_readable

    assert result["virtual_committed_from"].startswith("resident pages" if residency_readable() else "the pages")
    assert cell["paged"]["decode_steps"] == cell["virtual"]["decode_steps"] == 4
    assert cell["virtual"]["used_mib"] < cell["virtual"]["committed_mib"] < 8 < 255 < cell["paged"]["committed_mib"] <= 256
    assert cell["virtual_over_paged_decode"] > 0 and cell["virtual"]["faulting_forwards"] == 0


def test_bench_families_prints_every_family_beside_llama(capsys) -> None:
    """Random weights at one shape (no file): each family's decode through the plan, per byte vs Llama."""
    code, out, _ = _run(capsys, "bench", "families", "--families", "llama,gemma3,phi3", "--layers", "1",
                        "--new-tokens", "3", "--repeats", "1")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    rows = {r["family"]: r for r in result["families"]}
    assert list(rows) == ["llama", "gemma3", "phi3"] and rows["llama"]["per_byte_vs_llama"] == 1.0
    assert all(r["decode_tok_s"] > 0 and len(r["runs"]) == 1 and r["weight_mb"] > 0 for r in rows.values())
    assert rows["gemma3"]["weight_mb"] == rows["llama"]["weight_mb"]  # one shape, norms apart: same bytes to 0.1 MB
    code, _, err = _run(capsys, "bench", "families", "--families", "llama,gpt2")
    assert code == 2 and "--families takes some of llama, qwen3, phi3, mistral, gemma3" in err
    assert _run(capsys, "bench", "families", "--families", "llama,llama")[0] == 2


def test_generate_runs_the_virtual_layout(gguf_path, capsys) -> None:
    code, out, err = _run(capsys, "generate", "--kv-layout", "virtual", "--max-tokens", "4", "--prompt", "Hi")
    assert code == 0 and "generated 4 tokens" in err + out
    code, _, err = _run(capsys, "bench", "kv", "--layouts", "paged,contiguous")
    assert code == 2 and "--layouts takes paged, virtual, virtual_thp" in err


def _patch_tensor_info(path: Path, name: bytes, dims0: int | None = None, type_id: int | None = None) -> None:
    """Overwrite the first dimension or the type id of tensor `name` in a GGUF header."""
    data = bytearray(path.read_bytes())
    at = data.index(name) + len(name)  # then: u32 n_dims, u64 dims..., u32 type, u64 offset
    n_dims = int.from_bytes(data[at:at + 4], "little")
    if dims0 is not None:
        data[at + 4:at + 12] = dims0.to_bytes(8, "little")
    if type_id is not None:
        t = at + 4 + 8 * n_dims
        data[t:t + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_unknown_tensor_type_id_names_the_tensor(tmp_path, capsys) -> None:
    f = _write_gguf(tmp_path / "odd.gguf", "llama", gguf.GGMLQuantizationType.Q8_0)
    _patch_tensor_info(f, b"token_embd.weight", type_id=99)
    code, _, err = _run(capsys, "generate", "--model", str(f), "--prompt", "hi")
    assert code == 2 and "token_embd.weight" in err and "unknown GGML type id 99" in err and "Traceback" not in err


def test_width_that_does_not_fit_the_block_names_the_tensor(tmp_path, capsys) -> None:
    f = _write_gguf(tmp_path / "narrow.gguf", "llama", gguf.GGMLQuantizationType.Q4_K)
    _patch_tensor_info(f, b"token_embd.weight", dims0=100)
    code, _, err = _run(capsys, "generate", "--model", str(f), "--prompt", "hi")
    assert code == 2 and "token_embd.weight" in err and "does not fit Q4_K" in err


def test_metadata_that_disagrees_with_the_blocks_names_the_tensor(gguf_path, tmp_path, capsys) -> None:
    """A layer width in the metadata that the stored blocks do not have: one line, no traceback."""
    reader = gguf.GGUFReader(gguf_path)
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = 1024 if field.name == "llama.feed_forward_length" else field.contents()
        w.add_key_value(field.name, value, field.types[0],
                        sub_type=field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path / "bad.gguf"), "--prompt", "hi")
    assert code == 2 and "mlp.gate_proj.weight" in err and "1024" in err and "Traceback" not in err
