"""Qwen3.5/3.6 thinking: the `<think>...</think>` part of a chat reply is returned as
`reasoning_content`, the rest as `content` (as llama-server and vLLM do).

The Qwen3.5 template opens the block in the prompt when thinking is on (the prompt ends
with `<think>`), so the reply starts inside it; a reply may also open it itself. With
thinking off the template closes an empty block in the prompt and the reply is content.
A reply cut off before `</think>` is all reasoning. Leading whitespace of the reasoning and
of the content after it is dropped (the model writes `<think>\\n` and `</think>\\n\\n`); a
reply without a block is returned as it is. Works on streamed pieces: a
tail that could be the start of a tag is held back until the next piece settles it.
"""
from __future__ import annotations

from .text import held_tail

OPEN, CLOSE = "<think>", "</think>"


class ReasoningSplit:
    def __init__(self, prompt_opens_block: bool):
        self._mode = "reasoning" if prompt_opens_block else "start"
        self._pending = ""
        self._strip = prompt_opens_block  # at the start of a part after a tag: drop leading whitespace

    @staticmethod
    def opens_block(prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(OPEN)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) pieces of the reply so far; `final` flushes what is held back."""
        self._pending += text
        reasoning = content = ""
        while True:
            if self._strip:
                self._pending = self._pending.lstrip()
                self._strip = not self._pending and not final
            if self._mode == "start":
                if self._pending.startswith(OPEN):
                    self._mode, self._pending, self._strip = "reasoning", self._pending[len(OPEN):], True
                    continue
                if OPEN.startswith(self._pending) and not final:
                    return reasoning, content  # could still become "<think>"
                self._mode = "content"
            if self._mode == "content":
                content, self._pending = content + self._pending, ""
                return reasoning, content
            end = self._pending.find(CLOSE)
            if end >= 0:
                reasoning += self._pending[:end]
                self._mode, self._pending, self._strip = "content", self._pending[end + len(CLOSE):], True
                continue
            keep = 0 if final else held_tail(self._pending, (CLOSE,))
            reasoning += self._pending[:len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep:]
            return reasoning, content
