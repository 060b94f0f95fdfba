"""Real-size models: what compiling, loading and running one costs on this machine, ours and
llama.cpp's side by side on the same GGUF: compile seconds, cold and warm load seconds, peak
RSS against the files read plus the state memory the tool prints before allocating it,
prefill and decode tokens/s, and a 16-row verify in decode steps.

Every measurement is a child process of its own, so its peak RSS (VmHWM) is one user
process's, and phases do not share warm allocators or caches. "Cold" loads with the GGUFs
dropped from the page cache first (posix_fadvise DONTNEED: the first run after the files
were copied in, or after a reboot); "warm" is the next process, files cached; the speed
figures come from the warm process. Our loads leave out the one-off round-cost measurement
(runtime/costs.py), which is cached per artifact."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from .child import RESIDENT, Resident, run_child, serve_resident
from .measure import peak_rss
from .models import BenchModel

SCALE_CTX = 4096          # a context users run: the KV caches are part of the memory compared
PROMPT_TOKENS = 64
CHILD_TIMEOUT_S = 3600    # a 35B-A3B compile or load on 2 cores takes minutes, not hours


@dataclass(frozen=True)
class ScaleResult:
    engine: str                 # our backend, or "llama.cpp <version>"
    model: str
    file_bytes: int             # the GGUFs the engine reads (ours: target + draft; llama.cpp: target)
    state_bytes: int | None     # KV caches + recurrent states as our tool prints them (None: llama.cpp)
    compile_s: float | None     # None: llama.cpp has no compile step
    cold_load_s: float
    warm_load_s: float
    peak_rss_bytes: int         # the warm process's: load, prefill, decode and verify
    prefill_tps: float
    decode_tps: float
    generated_tokens: int
    verify16_steps: float

    @property
    def rss_over_need(self) -> float | None:
        """Peak RSS over the weights' files plus the printed states (the issue's 10% bound)."""
        return self.peak_rss_bytes / (self.file_bytes + self.state_bytes) if self.state_bytes is not None else None

    def to_dict(self) -> dict:
        return {**asdict(self), "rss_over_need": self.rss_over_need}


def decode_against_peer(rows: Sequence[dict]) -> list[dict]:
    """Per model and engine of ours: decode tok/s over the alternations (each row's `repeat`),
    each over llama.cpp's in the same alternation, and those ratios' median. This machine's
    memory bandwidth moves between runs minutes apart, so one pair of runs can put either
    engine ahead; the median of same-alternation ratios is the figure to quote."""
    def is_peer(r: dict) -> bool:
        return r["engine"].startswith("llama.cpp")

    peer = {(r["model"], r.get("repeat", 0)): r["decode_tps"] for r in rows if is_peer(r)}
    out = []
    for model, engine in dict.fromkeys((r["model"], r["engine"]) for r in rows if not is_peer(r)):
        ours = [r for r in rows if (r["model"], r["engine"]) == (model, engine)]
        theirs = [peer.get((model, r.get("repeat", 0))) for r in ours]
        ratios = [r["decode_tps"] / t for r, t in zip(ours, theirs) if t]
        out.append({"model": model, "engine": engine, "decode_tps": [r["decode_tps"] for r in ours],
                    "peer_decode_tps": [t for t in theirs if t],
                    "ratios": ratios, "median_ratio": statistics.median(ratios) if ratios else None})
    return out


def evict(paths: Sequence[Path]) -> None:
    """Drop `paths`' pages from the page cache (clean pages no process maps: ours are)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_scale(backend: str, model: BenchModel, work_dir: Path, *, max_tokens: int,
              numerics: str = "exact") -> ScaleResult:
    """Compile `model` for `backend` in `numerics` (timed, once per work folder), then a cold
    load and a warm load + run, each in a child process."""
    from .e2e import run_label

    out, compiled = _compiled(backend, model, work_dir, numerics)
    files = [model.target, model.draft]
    evict(files)
    cold = _child(dict(op="load", artifact=str(out)), f"loading {out} cold")
    warm = _child(dict(op="run", artifact=str(out), max_tokens=max_tokens), f"running {out}")
    return ScaleResult(run_label(backend, numerics), model.name, sum(p.stat().st_size for p in files),
                       warm["state_bytes"],
                       compiled["seconds"] if compiled else None, cold["load_s"], warm["load_s"], warm["peak_rss"],
                       warm["prefill_tps"], warm["decode_tps"], warm["generated_tokens"], warm["verify16_steps"])


def _compiled(backend: str, model: BenchModel, work_dir: Path, numerics: str) -> tuple[Path, dict | None]:
    """The pair's artifact folder for this run, compiled once per work folder (in a child
    process), and that compile's answer (None where it was there already)."""
    from .e2e import artifact_folder, run_label

    out = artifact_folder(work_dir, model, backend, numerics, SCALE_CTX)
    if (out / "manifest.yaml").is_file():
        return out, None
    request = dict(op="compile", target=str(model.target), draft=str(model.draft), out=str(out), backend=backend,
                   numerics=numerics)
    return out, _child(request, f"compiling {model.name} for {run_label(backend, numerics)}")


def bursts_unfit(rows: Sequence[dict], engine: str, available: int) -> str | None:
    """Why `engine` and llama.cpp cannot be loaded at once for decode_bursts (None: they can):
    the sum of their peak resident sets in this run's scale rows against `available` bytes."""
    ours = [r["peak_rss_bytes"] for r in rows if r["engine"] == engine]
    theirs = [r["peak_rss_bytes"] for r in rows if r["engine"].startswith("llama.cpp")]
    if not ours or not theirs:
        return f"this run has no peak RSS of {'llama.cpp' if ours else engine} (its scale run failed)"
    need = max(ours) + max(theirs)
    if need > available:
        return (f"both engines loaded at once need {need / 1e9:.1f} GB (their peak RSS), "
                f"{available / 1e9:.1f} GB are available")
    return None


def decode_bursts(backend: str, model: BenchModel, work_dir: Path, *, rounds: int, tokens: int,
                  numerics: str = "exact") -> dict:
    """Our decode and llama.cpp's in turns, both engines loaded at once in processes that stay
    (child.Resident): `rounds` rounds of a `tokens`-token greedy decode after the same prompt
    each, the order swapped every round so that a drift of the machine's memory bandwidth
    falls on both alike; per round our tok/s over llama.cpp's, and their median. The pair is
    compiled as run_scale compiles it (once per work folder)."""
    from .e2e import run_label
    from .peer import resident_llama_cpp

    out = _compiled(backend, model, work_dir, numerics)[0]
    ours_tps, peer_tps = [], []
    with Resident(__name__, dict(artifact=str(out)), f"running {out}", CHILD_TIMEOUT_S) as ours, \
            resident_llama_cpp(model.target, _prompt_ids(), n_ctx=SCALE_CTX) as peer:
        for i in range(rounds):
            for engine in (ours, peer) if i % 2 == 0 else (peer, ours):
                (ours_tps if engine is ours else peer_tps).append(engine.ask({"tokens": tokens})["decode_tps"])
    ratios = [a / b for a, b in zip(ours_tps, peer_tps)]
    return {"model": model.name, "engine": run_label(backend, numerics), "tokens": tokens, "decode_tps": ours_tps,
            "peer_decode_tps": peer_tps, "ratios": ratios, "median_ratio": statistics.median(ratios)}


def run_llama_cpp_scale(model: BenchModel, *, max_tokens: int) -> ScaleResult:
    """llama.cpp on the target alone: a cold load, then a warm load + run (its child process)."""
    from .peer import run_llama_cpp, run_llama_cpp_load

    evict([model.target])
    cold = run_llama_cpp_load(model.target, n_ctx=SCALE_CTX)
    warm = run_llama_cpp(model.name, model.target, _prompt_ids(), max_tokens, n_ctx=SCALE_CTX)
    return ScaleResult(warm.engine, model.name, model.target.stat().st_size, None, None, cold["load_s"],
                       warm.load_s, warm.peak_rss, warm.prefill_tps, warm.decode_tps, warm.generated_tokens,
                       warm.verify16_steps)


def _prompt_ids() -> list[int]:
    from .e2e import RANDOM_IDS_BELOW

    import numpy as np

    return np.random.default_rng(0).integers(16, RANDOM_IDS_BELOW, PROMPT_TOKENS).tolist()


def _child(request: dict, what: str) -> dict:
    return run_child(__name__, request, what, CHILD_TIMEOUT_S)


# -- the child's side -----------------------------------------------------------------------


def _compile(target: str, draft: str, out: str, backend: str, numerics: str) -> dict:
    from dflash_ir.artifact import compile_pair

    t0 = time.perf_counter()
    compile_pair(target, draft, out=out, backend=backend, n_ctx=SCALE_CTX, numerics=numerics)
    return {"seconds": time.perf_counter() - t0}


def _load(artifact: str):
    from dflash_ir.artifact import load_compiled

    t0 = time.perf_counter()
    engine = load_compiled(artifact, load_tokenizer=False, measure_costs=False)
    return engine, time.perf_counter() - t0


def _load_only(artifact: str) -> dict:
    return {"load_s": _load(artifact)[1]}


def _resident(artifact: str):
    from .e2e import after_first_tps

    engine, load_s = _load(artifact)
    ids = _prompt_ids()
    engine.generate(prompt_ids=ids, max_tokens=2, speculative=False, ignore_eos=True)  # first launches at these sizes

    def burst(tokens: int) -> dict:
        plain = engine.generate(prompt_ids=ids, max_tokens=tokens, speculative=False, ignore_eos=True)
        return {"decode_tps": after_first_tps(plain)}
    return {"load_s": load_s}, burst


def _run(artifact: str, max_tokens: int) -> dict:
    from .e2e import after_first_tps, verify_cost_in_decode_steps

    engine, load_s = _load(artifact)
    ids = _prompt_ids()
    engine.generate(prompt_ids=ids, max_tokens=2, speculative=False, ignore_eos=True)  # first launches at these sizes
    plain = engine.generate(prompt_ids=ids, max_tokens=max_tokens, speculative=False, ignore_eos=True)
    steps = verify_cost_in_decode_steps(engine.target, ids, repeats=3)
    need = engine.info["memory_need"]
    return {"load_s": load_s, "peak_rss": peak_rss(), "state_bytes": need.states,
            "prefill_tps": plain.stats.prefill_tps, "decode_tps": after_first_tps(plain),
            "generated_tokens": len(plain.tokens), "verify16_steps": steps}


if __name__ == "__main__":  # one request on stdin, its JSON answer on the last line of stdout
    if sys.argv[1:] == [RESIDENT]:
        serve_resident(_resident)
    else:
        request = json.loads(sys.stdin.read())
        print(json.dumps({"compile": _compile, "load": _load_only, "run": _run}[request.pop("op")](**request)))
