"""Incremental detokenization with correct UTF-8 across token boundaries, and stop strings.

Byte-level tokens can split one character over several tokens; decoding each token alone would
print replacement characters. We decode a short window (from `prefix_offset`) twice, with and
without the new tokens, and emit the difference only once it no longer ends in U+FFFD. The window
also keeps SentencePiece's leading-space handling right, which a lone token decode loses.
"""

from __future__ import annotations

from brisk.loader.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # decoded so far (stop string and what follows it removed)
        self.emitted = 0  # len(text) already handed out by `stream_delta`
        self.stopped = False  # a stop string was found
        self._prefix_offset = 0
        self._read_offset = 0
        # Text that may still turn into a stop string is held back from streaming.
        self._hold = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> None:
        """Add one token; its text appears once it completes a character."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            self._append(delta)

    def flush(self) -> None:
        """At the end, emit a trailing incomplete character (as U+FFFD) instead of dropping it."""
        if self._read_offset < len(self.ids) and not self.stopped:
            full = self._decode(self.ids[self._prefix_offset:])
            prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
            self._read_offset = len(self.ids)
            self._append(full[len(prefix):])

    def _append(self, delta: str) -> None:
        if self.stopped or not delta:
            return
        start = max(0, len(self.text) - self._hold)  # a stop string may begin in earlier text
        self.text += delta
        hits = [i for s in self.stop if (i := self.text.find(s, start)) != -1]
        if hits:  # the earliest-starting stop string wins; it and what follows are dropped
            self.text = self.text[:min(hits)]
            self.stopped = True

    def stream_delta(self, finished: bool) -> str:
        """New text safe to show now; everything remaining once `finished`."""
        limit = len(self.text) if (finished or self.stopped) else max(self.emitted, len(self.text) - self._hold)
        delta = self.text[self.emitted:limit]
        self.emitted = limit
        return delta
