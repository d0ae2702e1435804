"""Tokenizer: a `tokenizers.Tokenizer` plus the BOS/EOS policy and chat template of one model.

Built either from GGUF metadata (llama.cpp key names; the vocabulary is rebuilt the way HF
transformers' GGUF converter does, so both agree token for token) or from a HF tokenizer
directory (tokenizer.json + tokenizer_config.json), and saved back as the latter.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
import numpy as np
from tokenizers import Tokenizer as Backend

from brisk.errors import UserError
from brisk.loader import disk_cache
from brisk.loader.chat_template import (
    GEMMA_TEMPLATE,
    ChatTemplate,
    render_chat_template,
)

# Names llama.cpp treats as end-of-generation when present in a vocabulary, whatever the config's
# single eos says: chat models end a turn with a token other than their document EOS.
EOG_TOKEN_NAMES = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>", "<|return|>",
)  # fmt: skip

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, as in transformers' GGUF converter.
# Names absent here (e.g. "smollm", "gpt2") use ByteLevel's built-in GPT-2 regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_GIL_FREE_CHARS = 16384  # above this many characters (or ids), tokenize through the GIL-releasing batch calls


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in which byte-level vocabularies are spelled."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


@functools.lru_cache(maxsize=1)
def _inverse_byte_alphabet() -> dict[str, int]:
    return {c: b for b, c in _byte_alphabet().items()}


def _derive_merges(vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary that ships none: every split of a token into two known
    tokens, best score first (or lowest id first without scores), as transformers does: its
    order is a stable sort by (rank, len(left), len(right)) of the splits listed token by token,
    each token's by (id of left, id of right). One sort of plain tuples here, the listing index
    breaking ties (a 262k vocabulary: 1.6 s -> 1.1 s)."""
    ranked = scores if scores is not None else vocab
    get = vocab.get
    sign = -1 if scores is not None else 1  # best score first: ascending in -rank
    found: list[tuple[float, int, int, int, str, str]] = []
    for token, rank in ranked.items():
        n = len(token)
        local = []
        for i in range(1, n):
            a = get(token[:i])
            if a is not None and (b := get(token[i:])) is not None:
                local.append((a, b, i))
        local.sort()
        for _, _, i in local:
            found.append((sign * rank, sign * i, sign * (n - i), len(found), token[:i], token[i:]))
    found.sort()
    return [(f[4], f[5]) for f in found]


_MERGES_VERSION = b"derive_merges 1"  # change with _derive_merges' order: it keys the cached merges


def _derived_merges(vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """_derive_merges, kept on disk (loader/disk_cache.py) as the merges' token ids: Gemma 3's
    262k vocabulary takes ~1.4 s to derive in Python, ~0.1 s to read back."""
    h = hashlib.sha256(_MERGES_VERSION)
    h.update("\0".join(vocab).encode("utf-8", "surrogatepass"))
    h.update(np.fromiter(vocab.values(), np.int64, len(vocab)).tobytes())
    if scores is not None:
        h.update(np.fromiter(scores.values(), np.float64, len(scores)).tobytes())
    key = h.hexdigest()
    ids = disk_cache.load_array("merges", key)
    if ids is not None and ids.ndim == 2 and ids.shape[1] == 2:
        names = np.empty(max(vocab.values()) + 1, dtype=object)
        names[list(vocab.values())] = list(vocab)
        if ids.size == 0 or (ids.min() >= 0 and ids.max() < len(names)):
            return list(zip(names[ids[:, 0]].tolist(), names[ids[:, 1]].tolist()))
        # an entry that is not this vocabulary's: derive and rewrite it
    merges = _derive_merges(vocab, scores)
    disk_cache.store_array("merges", key, np.array([(vocab[a], vocab[b]) for a, b in merges], np.int32).reshape(-1, 2))
    return merges


def _merges(meta: Mapping[str, Any], vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    raw = meta.get("tokenizer.ggml.merges")
    if raw is None:
        return _derived_merges(vocab, scores)
    return [tuple(m.split(" ", 1)) for m in raw]  # type: ignore[misc]


def _byte_level_backend(meta: Mapping[str, Any], tokens: list[str]) -> Backend:
    """Byte-level BPE ("gpt2"): GPT-2, Llama 3, Qwen2, SmolLM... A token the file spells with
    characters outside the byte alphabet is respelled byte by byte, as transformers does."""
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    respell = {t: "".join(alphabet[b] for b in t.encode()) for t in tokens if not set(t) <= spelled}
    vocab = {respell.get(t, t): i for i, t in enumerate(tokens)}
    bpe = models.BPE(
        vocab=vocab, merges=_merges(meta, vocab, None), continuing_subword_prefix="", end_of_word_suffix=""
    )
    backend = Backend(bpe)
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        # The regex replaces ByteLevel's own GPT-2 split, so ByteLevel only maps bytes here.
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(meta: Mapping[str, Any], tokens: list[str]) -> Backend:
    """SentencePiece vocabularies ("llama"): BPE over pieces with `▁` for space and byte fallback
    (`<0x41>`), matching transformers' LlamaTokenizer; Phi-3 prepends its space in a normalizer."""
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = meta.get("tokenizer.ggml.scores")
    ranked = dict(zip(tokens, (float(s) for s in scores), strict=True)) if scores is not None else None
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab=vocab, merges=_merges(meta, vocab, ranked), fuse_unk=True, byte_fallback=True,
        unk_token=tokens[int(unk_id)] if unk_id is not None else None,
    )  # fmt: skip
    backend = Backend(bpe)
    # llama.cpp honours add_space_prefix=False; transformers ignores the key (always prepends).
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("general.architecture") == "phi3" and prefix:
        # Phi-3 keeps every leading space: "  hi" -> "▁▁▁hi" (Metaspace would give "▁▁hi").
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first" if prefix else "never", split=False)
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _gemma_backend(meta: Mapping[str, Any], tokens: list[str]) -> Backend:
    """Gemma's SentencePiece vocabulary, as transformers' GGUF converter rebuilds it: runs of
    spaces stored as real spaces are respelled with `▁`; the merges (the file has none) are
    every split of a token into two tokens, ranked by the token's place in the file (Gemma's
    scores do not follow its merge order); spaces become `▁` in a normalizer, no prefix space."""
    respelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(respelled)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab=vocab, merges=_derived_merges(vocab, {t: -i for i, t in enumerate(respelled)}), fuse_unk=True,
        byte_fallback=True, unk_token=respelled[int(unk_id)] if unk_id is not None else "<unk>",
    )  # fmt: skip
    backend = Backend(bpe)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _add_gguf_added_tokens(backend: Backend, meta: Mapping[str, Any], tokens: list[str], byte_level: bool) -> None:
    """Control tokens (and the named bos/eos/unk/pad) become special tokens, user-defined ones
    plain added tokens, so text such as `<|im_end|>` or `<think>` maps to one id, not pieces.
    In a byte-level vocabulary a "control" token spelled outside the byte alphabet is a llama.cpp
    mislabel; adding it would grow the vocabulary past the model's, so it is skipped (as HF does)."""
    spelled = set(_byte_alphabet().values()) if byte_level else None
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))  # absent: all normal
    control = {
        t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL and (spelled is None or set(t) <= spelled)
    }
    for key in ("bos", "eos", "unknown", "padding"):
        if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None and 0 <= int(i) < len(tokens):
            control.add(tokens[int(i)])
    ordered = [t for t in tokens if t in control]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ordered])
    # token_to_id, not a get_vocab() dict: building that dict of a 262k vocabulary took 0.2 s
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED and backend.token_to_id(t) is not None]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _builtin_template(meta: Mapping[str, Any]) -> str | None:
    """The chat template of a family whose GGUF files often carry none (Gemma)."""
    return GEMMA_TEMPLATE if str(meta.get("general.architecture", "")) in GEMMA_ARCHITECTURES else None


def _bos_is_turn_marker(bos: str | None, template: ChatTemplate | None) -> bool:
    """True when the chat template writes the BOS text literally once per message (ChatML's
    `<|im_start|>` in SmolLM2): then it is a turn marker that a converter recorded as BOS."""
    if not bos or template is None or bos not in template.source:
        return False
    roles = ("user", "assistant", "user")
    messages = [{"role": r, "content": f"m{i}"} for i, r in enumerate(roles)]
    try:  # bos_token is blanked so only literal occurrences count
        text = render_chat_template(template, messages, add_generation_prompt=False, bos_token="")
    except ValueError:
        return False
    return text.count(bos) >= len(messages)


class Tokenizer:
    """Encode/decode plus the model's BOS/EOS policy and chat template.

    BOS policy: `add_bos` follows the file's flag (GGUF `tokenizer.ggml.add_bos_token`, or
    tokenizer_config `add_bos_token`, else whatever tokenizer.json's post-processor does) EXCEPT
    when the BOS text is used literally as a turn marker by the chat template. Such a BOS is a
    converter artifact (SmolLM2's `<|im_start|>`): the original HF tokenizer adds nothing, and
    prepending it would change the model's input. BOS is added by the backend's post-processor,
    so tokenizer.json saved by `save_hf` carries the same policy.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.bos_token = backend.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token = backend.id_to_token(eos_token_id) if eos_token_id is not None else None
        self.chat_template = chat_template
        # A template jinja2 cannot compile must not stop plain completion with this model:
        # the error is kept and raised when chat is actually asked for.
        self._chat: ChatTemplate | None = None
        self._chat_error: ValueError | None = None
        try:
            self._chat = ChatTemplate(chat_template) if chat_template is not None else None
        except ValueError as e:
            self._chat_error = e
        marker = _bos_is_turn_marker(self.bos_token, self._chat)
        self.add_bos = bool(add_bos) and self.bos_token is not None and not marker
        bos = f"{self.bos_token}:0 " if self.add_bos else ""
        self._backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}$A:0", pair=f"{bos}$A:0 {bos}$B:1",
            special_tokens=[(self.bos_token, bos_token_id)] if self.add_bos else [],
        )  # fmt: skip
        named = {i for name in EOG_TOKEN_NAMES if (i := backend.token_to_id(name)) is not None}
        config_eos = {eos_token_id} if eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(config_eos | named | {int(i) for i in extra_eos_ids})
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in meta:
            raise UserError("GGUF metadata has no tokenizer.ggml.tokens; this file carries no tokenizer")
        tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
        if kind == "gpt2":
            backend = _byte_level_backend(meta, tokens)
        elif kind == "llama" and str(meta.get("general.architecture", "")) in GEMMA_ARCHITECTURES:
            backend = _gemma_backend(meta, tokens)
        elif kind == "llama":
            backend = _sentencepiece_backend(meta, tokens)
        else:
            raise UserError(
                f"unsupported GGUF tokenizer type tokenizer.ggml.model={kind!r}; supported: 'gpt2' (byte-level BPE), "
                "'llama' (SentencePiece BPE)"
            )
        _add_gguf_added_tokens(backend, meta, tokens, byte_level=kind == "gpt2")
        # Old sentencepiece files lack the flag; llama.cpp then adds BOS (so does transformers).
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos")}
        return cls(
            backend, bos_token_id=None if ids["bos"] is None else int(ids["bos"]),
            eos_token_id=None if ids["eos"] is None else int(ids["eos"]), add_bos=bool(add_bos),
            chat_template=meta.get("tokenizer.chat_template") or _builtin_template(meta), extra_eos_ids=extra,
        )  # fmt: skip

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json, and if present chat_template.jinja and
        generation_config.json (whose eos ids, often a list, join `eos_token_ids`)."""
        d = Path(path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (d / name).is_file():
                raise UserError(f"{name} not found in {d}; expected a HF tokenizer directory")
        backend = Backend.from_file(str(d / "tokenizer.json"))
        config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        bos_id, eos_id = (_token_id(backend, config.get(k)) for k in ("bos_token", "eos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # no flag: keep what tokenizer.json's own post-processor does
            add_bos = bos_id is not None and backend.encode("a").ids[:1] == [bos_id]
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        extra: list[int] = []
        if (d / "generation_config.json").is_file():
            gen_eos = json.loads((d / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
            extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        return cls(
            backend, bos_token_id=bos_id, eos_token_id=eos_id, add_bos=bool(add_bos),
            chat_template=template, extra_eos_ids=extra,
        )  # fmt: skip

    def save_hf(self, path: str | Path, model_max_length: int | None = None) -> None:
        """Write tokenizer.json + tokenizer_config.json, loadable by `from_hf_dir` and by
        `transformers.AutoTokenizer` (explicit add_bos/add_eos make it rebuild the same BOS rule)."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(d / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")

    # ---- use ---------------------------------------------------------------------------
    def backend_json(self) -> str:
        """The `tokenizers` JSON of this tokenizer (what grammar engines read: sample/structured.py)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text are recognised either way;
        `add_special_tokens` only controls the BOS (added when `add_bos`).

        Long texts go through `encode_batch`, the same pipeline, because tokenizers' `encode` holds
        the GIL for the whole call (2.5 s for 4 MB here) and `encode_batch` releases it: a server
        tokenizing in a worker thread keeps its event loop and engine thread running."""
        if len(text) > _GIL_FREE_CHARS:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > _GIL_FREE_CHARS:  # as in encode: the batch call releases the GIL
            return self._backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._backend.id_to_token(i)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for, also when it holds only part of a UTF-8 character
        (decoding it alone would give U+FFFD). Byte-level vocabularies spell bytes with GPT-2's
        alphabet; SentencePiece ones use `▁` for space and `<0xNN>` byte pieces."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if type(self._backend.decoder).__name__ == "ByteLevel":
            inverse = _inverse_byte_alphabet()
            if all(c in inverse for c in piece):
                return bytes(inverse[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if "\u2581" in piece:
            return piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def token_to_id(self, s: str) -> int | None:
        return self._backend.token_to_id(s)

    def special_token_id(self, text: str) -> int | None:
        """The id of the special (control) token spelled `text`, or None when `text` is not one.
        Special tokens vanish from text decoded with skip_special_tokens; grammars name them by id."""
        for i, added in self._backend.get_added_tokens_decoder().items():
            if added.special and added.content == text:
                return int(i)
        return None

    @property
    def template_takes_tools(self) -> bool:
        """The chat template reads the `tools` variable (HF's tool-calling templates do)."""
        return self._chat is not None and re.search(r"\btools\b", self._chat.source) is not None

    @property
    def template_source(self) -> str:
        return self._chat.source if self._chat is not None else ""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if self._chat_error is not None:
            raise self._chat_error
        return render_chat_template(
            self._chat, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token, tools=tools,
        )  # fmt: skip

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Rendered prompt ids. No BOS is added: a template that wants one writes it itself
        (`{{ bos_token }}`), and adding another would double it (HF does the same)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)


def _token_id(backend: Backend, token: Any) -> int | None:
    """tokenizer_config writes special tokens as strings or as AddedToken dicts."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None
