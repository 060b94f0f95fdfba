"""The peer: llama.cpp itself (through the `llama-cpp-python` package, which builds it from
source) on the same GGUF, same prompt ids, greedy: prompt processing and target-only decode
tokens/s, and how many of its greedy tokens equal ours (an independent check, not a test:
llama.cpp quantises activations to Q8 inside its Q8_0 products, so near-ties may differ).

DFlash through llama.cpp is not reachable here: llama-cpp-python's `draft_model` hook is a
Python-side proposer (prompt lookup), and its wheel builds no `llama-speculative` binary.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

INSTALL = "pip install llama-cpp-python (builds llama.cpp from source: ~10 min on 2 cores)"


@dataclass(frozen=True)
class PeerResult:
    engine: str
    model: str
    threads: int
    prompt_tokens: int
    generated_tokens: int
    prefill_tps: float
    decode_tps: float
    tokens: list[int]

    def to_dict(self) -> dict:
        return asdict(self)


def peer_unavailable() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed ({INSTALL})"
    return None


def run_llama_cpp(model_name: str, gguf: Path, prompt_ids: Sequence[int], max_tokens: int, *, n_ctx: int = 512,
                  threads: int | None = None) -> PeerResult:
    """Greedy target-only generation of `max_tokens` after `prompt_ids`, timed per phase
    (after one warm-up pass, as for our backends)."""
    import llama_cpp

    threads = threads or os.cpu_count() or 1
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=max(len(prompt_ids), 32), n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))

    def generate(n: int) -> tuple[list[int], float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(list(prompt_ids))
        prefill = time.perf_counter() - t0
        tokens = [int(np.argmax(last_logits()))]
        t0 = time.perf_counter()
        while len(tokens) < n:
            llm.eval([tokens[-1]])
            tokens.append(int(np.argmax(last_logits())))
        return tokens, prefill, time.perf_counter() - t0

    generate(4)
    tokens, prefill_s, decode_s = generate(max_tokens)
    return PeerResult("llama.cpp " + llama_cpp.__version__, model_name, threads, len(prompt_ids), len(tokens),
                      len(prompt_ids) / prefill_s, (len(tokens) - 1) / decode_s if decode_s else 0.0, tokens)
