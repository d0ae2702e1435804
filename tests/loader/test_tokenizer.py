"""brisk.loader.tokenizer / chat_template against HF transformers on the same GGUF metadata."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from brisk.loader.chat_template import ChatTemplate, render_chat_template, validate_messages  # noqa: E402
from brisk.loader.tokenizer import Tokenizer  # noqa: E402

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé Ångström — déjà vu; 東京は日本の首都です。 北京欢迎你",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 heart ❤️",
    "def f(x):\n\tif x:\n\t\treturn [i ** 2 for i in range(10)]\n    else:\n        pass\n",
    "spaces    runs     and\t\ttabs   \n\n\n  trailing   ",
    "line one\nline two\r\nline three\n\n",
    "digits 1234567890 3.14159 1,000,000 2024-01-31",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <|im_end|>end",
    "I'm sure they'll say we've done it, isn't it? DON'T SHOUT",
    "",
    " ",
    "\n",
]

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number."},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi! 👋"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Write\n\tcode  please."},
    ],
}


@pytest.fixture(scope="module")
def meta(gguf_path: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(gguf_path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general."))}


@pytest.fixture(scope="module")
def ours(meta: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def hf(hf_tokenizer: Any) -> Any:
    """The session's HF tokenizer (conftest): its conversion from the GGUF takes 11-16 s here."""
    return hf_tokenizer


def _write_gguf(path: Path, meta: dict[str, Any]) -> Path:
    """A tensor-less GGUF holding only tokenizer metadata, plus the few llama keys HF needs."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128), w.add_embedding_length(16), w.add_block_count(1), w.add_feed_forward_length(32)
    w.add_head_count(2), w.add_head_count_kv(2), w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(meta["tokenizer.ggml.tokens"]))
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"]), w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.unknown_token_id" in meta:
        w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


# ---- the default model against HF ----------------------------------------------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_hf(ours: Tokenizer, hf: Any, add_special_tokens: bool) -> None:
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens), text


def test_special_tokens_in_text_are_single_ids(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_hf(ours: Tokenizer, hf: Any, skip: bool) -> None:
    rng = random.Random(0)
    sequences = [hf.encode(t) for t in TEXTS]
    sequences += [[rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    sequences += [[0, 1, 2, 17, 3, 1000], [1, 2, 1, 2]]
    for ids in sequences:
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    for text in TEXTS:  # round trip; the default model adds no BOS
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_vocab_and_special_ids(ours: Tokenizer, hf: Any) -> None:
    assert ours.vocab_size == len(hf) == 49152
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert ours.add_bos is False
    assert 2 in ours.eos_token_ids and 0 in ours.eos_token_ids  # <|im_end|>, <|endoftext|>
    assert 1 not in ours.eos_token_ids
    assert ours.id_to_token(2) == "<|im_end|>" and ours.token_to_id("<|im_start|>") == 1


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_hf(ours: Tokenizer, hf: Any, name: str, gen: bool) -> None:
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
    assert ours.encode_chat(messages, add_generation_prompt=gen) == list(ids)


def test_save_hf_round_trip(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save_hf(tmp_path, model_max_length=8192)
    back = Tokenizer.from_hf_dir(tmp_path)
    hf_back = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (back.vocab_size, back.bos_token_id, back.eos_token_id, back.add_bos) == (
        ours.vocab_size, ours.bos_token_id, ours.eos_token_id, ours.add_bos,
    )  # fmt: skip
    assert back.eos_token_ids == ours.eos_token_ids and back.chat_template == ours.chat_template
    for text in TEXTS:
        for special in (True, False):
            assert back.encode(text, special) == ours.encode(text, special), text
            assert hf_back.encode(text, add_special_tokens=special) == ours.encode(text, special), text
    messages = CONVERSATIONS["multi_turn"]
    assert hf_back.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        ours.apply_chat_template(messages)
    )
    assert back.encode_chat(messages) == ours.encode_chat(messages)


# ---- BOS policy ------------------------------------------------------------------------------


def test_bos_used_as_turn_marker_is_not_added(meta: dict[str, Any]) -> None:
    # A converter that flags add_bos_token on SmolLM2 would prepend <|im_start|> to every prompt.
    tok = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.add_bos_token": True})
    assert tok.add_bos is False and tok.encode("hi") == [6004]


def test_real_bos_is_added_when_flagged(meta: dict[str, Any]) -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok = Tokenizer.from_gguf_metadata(
        {**meta, "tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": template}
    )
    assert tok.add_bos is True
    assert tok.encode("hi") == [1, 6004] and tok.encode("hi", add_special_tokens=False) == [6004]
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids[1] != 1  # the template's BOS, not doubled


# ---- other GGUF tokenizer kinds against HF's converter -------------------------------------


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_byte_level_split_regex_matches_hf(meta: dict[str, Any], tmp_path: Path, pre: str) -> None:
    variant = {**meta, "tokenizer.ggml.pre": pre}
    path = _write_gguf(tmp_path / "t.gguf", variant)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = Tokenizer.from_gguf_metadata(variant)
    for text in TEXTS + ["numbers 1234567 and 12", "x   \n\n  y"]:
        assert ours.encode(text) == ref.encode(text), text


def _sentencepiece_meta() -> dict[str, Any]:
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "he", "ll", "llo", "▁he", "▁hello", "or", "▁wor"]
    pieces += ["▁world", "<think>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 1) + [4],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_sentencepiece_gguf_matches_hf(tmp_path: Path) -> None:
    meta = _sentencepiece_meta()
    path = _write_gguf(tmp_path / "spm.gguf", meta)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = Tokenizer.from_gguf_metadata(meta)
    assert ours.add_bos is True and ours.eos_token_ids == {2}  # old files: BOS on by default
    texts = ["hello world", "  hello", "", "hello\n\nworld ", "<s>hello</s>", "héllo wörld 😀", "a <think> b <unk>"]
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, special) == ref.encode(text, add_special_tokens=special), text
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), text


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bert", "t5", None])
def test_unsupported_gguf_tokenizer_type(kind: str | None) -> None:
    meta = {**_sentencepiece_meta(), "tokenizer.ggml.model": kind}
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer type"):
        Tokenizer.from_gguf_metadata(meta)


def test_gguf_without_tokens() -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


def test_from_hf_dir_missing_files(ours: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json not found in .*"):
        Tokenizer.from_hf_dir(tmp_path)
    ours.save_hf(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="tokenizer_config.json not found"):
        Tokenizer.from_hf_dir(tmp_path)


def test_from_hf_dir_config_variants(ours: Tokenizer, tmp_path: Path) -> None:
    """AddedToken dicts for bos/eos, a separate chat_template.jinja, generation_config eos list."""
    ours.save_hf(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": "<|im_start|>", "special": True, "__type": "AddedToken"}
    config["eos_token"] = {"content": "<|endoftext|>", "special": True, "__type": "AddedToken"}
    del config["chat_template"], config["add_bos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (1, 0, False)
    assert {0, 2, 5} <= tok.eos_token_ids
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "must be a list"),
        ([], "at least one message"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], "has no 'role'"),
        ([{"role": 3, "content": "hi"}], r"\['role'\] must be a string"),
        ([{"role": "wizard", "content": "hi"}], "unknown role 'wizard'"),
        ([{"role": "user"}], "has no 'content'"),
        ([{"role": "user", "content": 5}], r"\['content'\] must be a string"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "parts must be"),
    ],
)
def test_malformed_messages(ours: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ours.apply_chat_template(messages)


def test_message_forms_accepted() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert validate_messages(parts)[0]["content"] == "ab"
    call = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert validate_messages(call)[0]["content"] is None


def test_no_chat_template(meta: dict[str, Any]) -> None:
    tok = Tokenizer.from_gguf_metadata({k: v for k, v in meta.items() if k != "tokenizer.chat_template"})
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_broken_template_fails_only_chat(meta: dict[str, Any]) -> None:
    tok = Tokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template": "{% for m in messages %}"})
    assert tok.encode("hi") == [6004]
    with pytest.raises(ValueError, match="does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_helpers_and_errors() -> None:
    user = [{"role": "user", "content": "<a> & 'b' é"}]
    assert render_chat_template("{{ messages[0]['content'] | tojson }}", user) == "\"<a> & 'b' é\""
    assert render_chat_template("{{ strftime_now('%Y') | length }}", user) == "4"
    assert render_chat_template("{% generation %}x{% endgeneration %}{{ bos_token }}", user, bos_token="<s>") == "x<s>"
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", user)
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ValueError):  # the sandbox refuses attribute escapes
        render_chat_template("{{ ''.__class__.__mro__ }}", user)
    with pytest.raises(ValueError):
        render_chat_template("{% set ns = namespace(_x=1) %}", user)
