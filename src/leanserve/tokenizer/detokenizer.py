"""Incremental detokenization for streaming, with bounded state per request.

`tokenizers`' DecodeStream keeps only a small window of ids and yields text once it forms
complete UTF-8 characters, so a multi-byte character split across tokens is never emitted in
halves, and word-leading spaces come out right. Stop strings are matched here, on the text,
because they belong to the API side of the process split (the engine only sees token ids).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from .tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output
        # Text that might be the start of a stop string is held back until it is decided.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # everything released so far
        self._pending = ""
        self.stopped_on: str | None = None

    def add(self, token_ids) -> str:
        """Feeds new token ids; returns the text delta that is safe to release."""
        if self.stopped_on is not None:
            return ""
        for tid in token_ids:
            piece = self._stream.step(self._backend, int(tid))
            if piece:
                self._pending += piece
        if self._stop:
            return self._release_checking_stops()
        delta, self._pending = self._pending, ""
        self.text += delta
        return delta

    def step(self, token_id: int, finish_reason: str | None) -> tuple[str, str | None]:
        """One engine event (token_id -1: none; finish_reason: the engine's, or None): returns
        the text to release and, if the choice ended, why. A stop string ends it with "stop"
        (the caller aborts the engine request); the engine's own finish flushes what was held."""
        delta = self.add([token_id]) if token_id >= 0 else ""
        if self.stopped_on is not None:
            return delta, "stop"
        if finish_reason:
            return delta + self.flush(), finish_reason
        return delta, None

    def flush(self) -> str:
        """At the end of the request: release what was held back for stop matching."""
        if self.stopped_on is not None:
            return ""
        delta, self._pending = self._pending, ""
        self.text += delta
        return delta

    def _release_checking_stops(self) -> str:
        # Search only the window where a stop string could newly appear.
        window_start = max(0, len(self.text) - self._hold)
        window = self.text[window_start:] + self._pending
        best = None
        for s in self._stop:
            i = window.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            end = i + (len(s) if self._include_stop else 0)
            full = window[:end]
            delta = full[len(self.text) - window_start :] if end >= len(self.text) - window_start else ""
            self.text = self.text[:window_start] + full if end >= len(self.text) - window_start else self.text
            self._pending = ""
            self.stopped_on = s
            return delta
        keep = min(self._hold, len(self._pending))
        delta = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        self.text += delta
        return delta
