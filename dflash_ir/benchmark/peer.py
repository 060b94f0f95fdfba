"""The peer: llama.cpp itself (through the `llama-cpp-python` package, which builds it from
source) on the same GGUF, same prompt ids, greedy: prompt processing and target-only decode
tokens/s, and how many of its greedy tokens equal ours (an independent check, not a test:
llama.cpp quantises activations to Q8 inside its Q8_0 products, so near-ties may differ).

DFlash through llama.cpp is not reachable here: llama-cpp-python's `draft_model` hook is a
Python-side proposer (prompt lookup), and its wheel builds no `llama-speculative` binary.

llama.cpp runs in a child process: a build made for another CPU, or one whose AMX tile
kernels a sandboxed kernel refuses, dies of SIGILL, and that must fail this one
measurement with the fix, not the whole benchmark (or test session) with it.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from dflash_ir.backends.base import host_cpu_flags

from .child import RESIDENT, Resident, run_child, serve_resident
from .measure import peak_rss

INSTALL = "pip install llama-cpp-python (builds llama.cpp from source: ~10 min on 2 cores)"
# llama.cpp built for this machine's x86-64 vector units without AMX (`make bench` uses it)
PORTABLE_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON'
                  '{extensions}" pip install --force-reinstall --no-cache-dir --no-binary llama-cpp-python '
                  'llama-cpp-python')
# ggml's options for the extensions past AVX2, each by the /proc/cpuinfo flag that must be there
# (a Zen 4 has AVX-512 VNNI but not the VEX-coded AVX-VNNI: with it on, llama.cpp dies of SIGILL)
EXTENSIONS = {"GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni",
              "GGML_AVX512_BF16": "avx512_bf16", "GGML_AVX_VNNI": "avx_vnni"}
PEER_TIMEOUT_S = 900
# source bytes a second below which a quantisation counts as hung: the 35B-A3B's 37 GB Q8_0 took
# 20 min (31 MB/s) on 2 cores, past the 900 s that bounds the other requests
QUANTIZE_SLOWEST = 8e6


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
    verify16_steps: float  # a 16-token batch (all rows' logits) over one decode step, medians
    load_s: float          # llama_model_load + context, this process (page cache as it found it)
    peak_rss: int          # the process's peak resident set (VmHWM), bytes: the mapped GGUF counts

    def to_dict(self) -> dict:
        return asdict(self)


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset / cgroup affinity), llama.cpp's thread count."""
    return len(os.sched_getaffinity(0))


def peer_unavailable() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed ({INSTALL})"
    return None


class PeerCrashed(RuntimeError):
    """llama.cpp's process died of a signal: its build does not run on this machine."""


def portable_build_command() -> str:
    """The llama-cpp-python rebuild for this CPU: AVX2, plus each extension of EXTENSIONS that
    /proc/cpuinfo lists, never AMX."""
    flags = host_cpu_flags()
    return PORTABLE_BUILD.format(extensions="".join(f" -D{option}=ON" for option, flag in EXTENSIONS.items()
                                                    if flag in flags))


def run_llama_cpp(model_name: str, gguf: Path, prompt_ids: Sequence[int], max_tokens: int, *, n_ctx: int = 512,
                  threads: int | None = None) -> PeerResult:
    """Greedy target-only generation of `max_tokens` after `prompt_ids`, timed per phase
    (after one warm-up pass, as for our backends), in a child process."""
    request = dict(op="generate", model_name=model_name, gguf=str(gguf), prompt_ids=[int(i) for i in prompt_ids],
                   max_tokens=int(max_tokens), n_ctx=n_ctx, threads=threads)
    return PeerResult(**_child(request, gguf))


def run_llama_cpp_load(gguf: Path, *, n_ctx: int = 512) -> dict:
    """llama.cpp loading `gguf` and nothing else, in a child process: {load_s}."""
    return _child(dict(op="load", gguf=str(gguf), n_ctx=n_ctx), gguf)


def _child(request: dict, gguf: Path, timeout_s: float = PEER_TIMEOUT_S) -> dict:
    """Run one request (`op`: generate, load or quantize) in a child process; its JSON answer."""
    def died(signal_name: str) -> Exception:
        return PeerCrashed(f"llama.cpp died of {signal_name} on {gguf}: its build uses instructions this machine "
                           f"refuses (built for another CPU, or AMX tiles a sandboxed kernel does not grant); rebuild "
                           f"it for this machine: {portable_build_command()}")
    return run_child(__name__, request, f"llama.cpp on {gguf}", timeout_s, died)


def quantize(src: Path, dst: Path, preset: str, *, threads: int = 1) -> Path:
    """llama-quantize's `preset` (Q4_K_M, Q5_K_M, IQ4_XS, ...: its per-tensor type mix) of the
    GGUF `src`, written to `dst` by llama.cpp's own llama_model_quantize, in a child process
    (as generation: a build for another CPU dies of SIGILL). A quantised `src` is requantised
    (`--allow-requantize`): the type mix is the same, the values go through `src`'s rounding."""
    _child(dict(op="quantize", src=str(src), dst=str(dst), preset=preset, threads=threads), Path(src),
           max(PEER_TIMEOUT_S, Path(src).stat().st_size / QUANTIZE_SLOWEST))
    return Path(dst)


def _quantize(src: str, dst: str, preset: str, threads: int) -> dict:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    try:
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset}")
    except AttributeError:
        raise ValueError(f"llama.cpp has no quantisation preset {preset!r}") from None
    params.nthread = threads
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {dst} ({preset}) failed")
    return {}


def _llama(gguf: str, n_ctx: int, n_batch: int, threads: int):
    """The model loaded with every row's logits kept (what a verify asks), and the seconds it took."""
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_batch, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    return llm, time.perf_counter() - t0


def _load(gguf: str, n_ctx: int) -> dict:
    load_s = _llama(gguf, n_ctx, 32, usable_cpus())[1]
    return {"load_s": load_s}


def _session(gguf: str, prompt_ids: Sequence[int], n_ctx: int, threads: int):
    """The model loaded, the seconds it took, and generate(n): greedy target-only generation
    of n tokens after `prompt_ids` -> (tokens, prefill seconds, decode seconds)."""
    import llama_cpp

    llm, load_s = _llama(gguf, n_ctx, max(len(prompt_ids), 32), threads)
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

    return llm, load_s, generate


def _decode_tps(tokens: list, decode_s: float) -> float:
    return (len(tokens) - 1) / decode_s if decode_s else 0.0


def _generate(model_name: str, gguf: str, prompt_ids: Sequence[int], max_tokens: int, n_ctx: int,
              threads: int | None) -> dict:
    import llama_cpp

    threads = threads or usable_cpus()
    llm, load_s, generate = _session(gguf, prompt_ids, n_ctx, threads)

    def verify_steps(repeats: int = 5) -> float:
        """A 16-token batch with every row's logits (what a DFlash verify asks) vs one decode step."""
        decode, batch = [], []
        for i in range(repeats):  # from the prompt each time: a recurrent state cannot drop rows
            llm.reset()
            llm.eval(list(prompt_ids))
            t0 = time.perf_counter()
            llm.eval([int(prompt_ids[i % len(prompt_ids)])])
            t1 = time.perf_counter()
            llm.eval([int(t) for t in prompt_ids[:16]])
            batch.append(time.perf_counter() - t1)
            decode.append(t1 - t0)
        return float(np.median(batch) / np.median(decode))

    generate(4)
    tokens, prefill_s, decode_s = generate(max_tokens)
    return PeerResult("llama.cpp " + llama_cpp.__version__, model_name, threads, len(prompt_ids), len(tokens),
                      len(prompt_ids) / prefill_s, _decode_tps(tokens, decode_s), tokens, verify_steps(), load_s,
                      peak_rss()).to_dict()


def resident_llama_cpp(gguf: Path, prompt_ids: Sequence[int], *, n_ctx: int) -> Resident:
    """llama.cpp loaded in a process that stays (child.Resident): each ask({"tokens": n})
    decodes n tokens after `prompt_ids`, greedy, and answers {"decode_tps"}."""
    request = dict(gguf=str(gguf), prompt_ids=[int(i) for i in prompt_ids], n_ctx=n_ctx)
    return Resident(__name__, request, f"llama.cpp on {gguf}", PEER_TIMEOUT_S)


def _resident(gguf: str, prompt_ids: Sequence[int], n_ctx: int):
    llm, load_s, generate = _session(gguf, prompt_ids, n_ctx, usable_cpus())
    generate(4)

    def burst(tokens: int) -> dict:
        out, _, decode_s = generate(tokens)
        return {"decode_tps": _decode_tps(out, decode_s)}
    return {"load_s": load_s}, burst


if __name__ == "__main__":  # `--build-command` prints the rebuild; otherwise one request on stdin
    if sys.argv[1:] == ["--build-command"]:
        print(portable_build_command())
    elif sys.argv[1:] == [RESIDENT]:
        serve_resident(_resident)
    else:
        request = json.loads(sys.stdin.read())
        print(json.dumps({"generate": _generate, "load": _load, "quantize": _quantize}[request.pop("op")](**request)))
