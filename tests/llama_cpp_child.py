"""llama.cpp (through llama-cpp-python) on a GGUF, in a child process, for tests that compare
with it: a build made for another CPU dies of SIGILL, and that must skip the test with the
reason, not end the test session.

    tokenize(gguf, texts, special)      -> llama.cpp's ids of each text (no BOS added)
    greedy(gguf, prompts, n_tokens)     -> per prompt: the last prompt row's logits and
                                           n_tokens greedy continuation ids
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys

TIMEOUT_S = 600


def _run(request: dict) -> dict:
    import pytest

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pytest.skip("llama-cpp-python is not installed (pip install llama-cpp-python: the bench extra)")
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(request), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if proc.returncode < 0:
        pytest.skip(f"llama.cpp died of {signal.Signals(-proc.returncode).name}: its build does not run on this "
                    "machine (see dflash_ir/benchmark/peer.py for the portable rebuild)")
    if proc.returncode:
        raise RuntimeError(f"llama.cpp failed on {request['gguf']}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tokenize(gguf, texts: list[str], *, special: bool = False) -> list[list[int]]:
    return _run({"op": "tokenize", "gguf": str(gguf), "texts": texts, "special": special})["ids"]


def greedy(gguf, prompts: list[list[int]], n_tokens: int) -> list[dict]:
    return _run({"op": "greedy", "gguf": str(gguf), "prompts": prompts, "n_tokens": n_tokens})["runs"]


def _serve(request: dict) -> dict:
    import llama_cpp
    import numpy as np

    if request["op"] == "tokenize":
        llm = llama_cpp.Llama(model_path=request["gguf"], vocab_only=True, verbose=False)
        return {"ids": [llm.tokenize(t.encode(), add_bos=False, special=request["special"]) for t in request["texts"]]}
    longest = max(len(p) for p in request["prompts"]) + request["n_tokens"]
    llm = llama_cpp.Llama(model_path=request["gguf"], n_ctx=max(64, longest), n_batch=max(64, longest),
                          n_threads=1, type_k=0, type_v=0, verbose=False)  # f32 KV cache (GGML_TYPE_F32)
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()

    runs = []
    for prompt in request["prompts"]:
        llm.reset()
        llm.eval(prompt)
        logits = last_logits()
        tokens = [int(np.argmax(logits))]
        while len(tokens) < request["n_tokens"]:
            llm.eval([tokens[-1]])
            tokens.append(int(np.argmax(last_logits())))
        runs.append({"last_logits": logits.tolist(), "tokens": tokens})
    return {"runs": runs}


if __name__ == "__main__":
    print(json.dumps(_serve(json.loads(sys.stdin.read()))))
