"""End to end on one backend and model pair: prefill tokens/s, target-only decode tokens/s,
speculative tokens/s with 15 proposals every round and with the cost-aware length, tau, and
what a 16-row verify costs in decode steps (the figure DFlash's speed-up divides by),
through the same compile + load path users take. Greedy, so the speculative tokens must
equal the target-only ones: a run where they differ is an error, not a number."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dflash_ir.artifact import compile_pair, load_compiled

from .models import BenchModel

RANDOM_IDS_BELOW = 2048  # prompt ids for models without a real tokenizer: inside every synthetic vocabulary


@dataclass(frozen=True)
class EndToEnd:
    backend: str
    model: str
    prompt_tokens: int
    generated_tokens: int
    prefill_tps: float
    decode_tps: float            # target only
    speculative_tps: float       # 15 proposals every round
    adaptive_tps: float          # the cost-aware length
    tau: float
    accept_hist: dict[int, int]
    prompt_ids: list[int]
    tokens: list[int]
    verify16_steps: float        # one 16-row verify's time over one decode step's (medians)

    @property
    def speedup(self) -> float:
        return self.speculative_tps / self.decode_tps if self.decode_tps else 0.0

    @property
    def adaptive_speedup(self) -> float:
        return self.adaptive_tps / self.decode_tps if self.decode_tps else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup, "adaptive_speedup": self.adaptive_speedup}


def run_label(backend: str, numerics: str = "exact") -> str:
    """How results name a run: the backend, and the numerics mode where it is not exact."""
    return backend if numerics == "exact" else f"{backend}/{numerics}"


def artifact_folder(work_dir: Path, model: BenchModel, backend: str, numerics: str, n_ctx: int) -> Path:
    """Where a run's pair is compiled: one folder per model, run and context size."""
    return Path(work_dir) / f"{model.name}-{run_label(backend, numerics).replace('/', '-')}-{n_ctx}"


def compiled_engine(backend: str, model: BenchModel, work_dir: Path, *, n_ctx: int, numerics: str = "exact"):
    """The pair compiled for `backend` in `numerics` (once per work folder) and loaded, its
    round costs measured."""
    out = artifact_folder(work_dir, model, backend, numerics, n_ctx)
    if not (out / "manifest.yaml").is_file():
        compile_pair(model.target, model.draft, out=out, backend=backend, n_ctx=n_ctx, numerics=numerics)
    return load_compiled(out, load_tokenizer=model.prompt is not None)


def prompt_ids(engine, model: BenchModel, n: int = 64) -> list[int]:
    """The model's prompt, or n random ids for a model without a real tokenizer."""
    if model.prompt is not None:
        return engine.encode_prompt(model.prompt)
    return np.random.default_rng(0).integers(16, RANDOM_IDS_BELOW, n).tolist()


def run_end_to_end(backend: str, model: BenchModel, work_dir: Path, *, prompt_tokens: int = 64,
                   max_tokens: int = 32, n_ctx: int = 512, seconds: float = 60.0, numerics: str = "exact") -> EndToEnd:
    """`max_tokens` per timed generation, fewer where the warm-up's speed says that many
    would take longer than `seconds` (a slow backend on the synthetic target: minutes per
    token); the result records how many were generated."""
    engine = compiled_engine(backend, model, work_dir, n_ctx=n_ctx, numerics=numerics)
    label = run_label(backend, numerics)
    ids = prompt_ids(engine, model, prompt_tokens)
    # warm-up (first launches build kernels on some backends), which also prices a token
    warm = [engine.generate(prompt_ids=ids, max_tokens=4, speculative=s, adaptive=False, ignore_eos=True)
            for s in (True, False)]
    affordable = min(seconds * after_first_tps(w) for w in warm)
    n = max(2, min(max_tokens, int(affordable)))
    plain = engine.generate(prompt_ids=ids, max_tokens=n, speculative=False, ignore_eos=True)
    runs = {}
    for adaptive in (False, True):
        runs[adaptive] = engine.generate(prompt_ids=ids, max_tokens=n, adaptive=adaptive, n_max=15, ignore_eos=True)
        if runs[adaptive].tokens != plain.tokens:
            raise AssertionError(f"{label}/{model.name}: speculative tokens (adaptive={adaptive}) differ from "
                                 f"target-only tokens:\n  speculative {runs[adaptive].tokens}\n  target-only {plain.tokens}")
    spec = runs[False]
    return EndToEnd(label, model.name, len(ids), len(plain.tokens), plain.stats.prefill_tps, after_first_tps(plain),
                    after_first_tps(spec), after_first_tps(runs[True]), spec.stats.tau,
                    dict(sorted(spec.stats.accept_hist.items())), list(ids), plain.tokens,
                    verify_cost_in_decode_steps(engine.target, ids, repeats=3 if n < max_tokens else 5))


def verify_cost_in_decode_steps(target, ids, *, rows: int = 16, repeats: int = 5) -> float:
    """Median time of a `rows`-row verify with its commit of one row (greedy ids read back, the
    device done with the commit) over the median time of a decode step, alternated on top of
    the prompt."""
    target.reset()
    target.prefill(ids)
    decode, verify = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        np.asarray(target.decode(int(ids[i % len(ids)])).greedy)
        t1 = time.perf_counter()
        np.asarray(target.verify(ids[:rows]).greedy)
        target.commit(1)
        np.asarray(next(iter(target.states.values()))[:1])  # a row of a state: in order after the commit's work
        verify.append(time.perf_counter() - t1)
        decode.append(t1 - t0)
    return float(np.median(verify) / np.median(decode))


def after_first_tps(gen) -> float:
    """Tokens/s after the first token (which prefill produces), as llama.cpp counts decode."""
    seconds = gen.stats.generate_seconds
    return (len(gen.tokens) - 1) / seconds if seconds else 0.0
