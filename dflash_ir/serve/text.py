"""Committed token ids -> the text a client sees: UTF-8 completed, end-of-generation tokens
dropped, cut before the first stop string.

Streaming and non-streaming replies both go through `TextStream` (the non-streaming reply is
the concatenation of its pieces), so the two are equal by construction. A piece never ends
inside a possible stop string: the tail that could still grow into one is held back until
the next tokens settle it.
"""
from __future__ import annotations

from typing import Collection, Sequence

from dflash_ir.models.tokenizer import StreamDecoder


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = (), hidden_ids: Collection[int] = ()):
        self._decoder = StreamDecoder(tokenizer)
        self._stop = tuple(s for s in stop if s)
        self._hidden = frozenset(hidden_ids)
        self._pending = ""
        self.stopped = False  # a stop string was found: nothing more is emitted

    def feed(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._pending += "".join(self._decoder.feed(t) for t in ids if t not in self._hidden)
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._pending += self._decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self._pending
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped, self._pending = True, ""
            return text[:min(hits)]
        keep = 0 if final else held_tail(text, self._stop)
        self._pending = text[len(text) - keep:]
        return text[:len(text) - keep]


def held_tail(text: str, marks: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is the start of one of `marks` (and so must
    wait for the next piece to tell whether the mark follows)."""
    return max((n for s in marks for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
               default=0)
