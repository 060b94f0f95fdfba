"""llama.cpp's own DFlash on the shipped SmolLM2 pair: python -m train.llama_cpp_dflash --bin DIR [-n 128] [--prompts K].

Runs llama.cpp's binaries from DIR (a llama.cpp build; train/README.md shows one from the source
the llama-cpp-python sdist vendors) on the held-out chat prompts, each rendered by the target's
chat template: `llama-tokenize` (its prompt ids against ours), `llama-speculative-simple
--spec-type draft-dflash --spec-draft-n-max 15` (greedy: its text, drafted and accepted counts,
decode tokens/s) and `llama-completion` (greedy, target only: decode tokens/s). Its texts are
compared with our target-only texts from demo/smollm2-measurements.json (`python -m
train.measure smollm2` writes them, for the same prompts and token budget); where they differ,
our target's logits at the first differing token say how far apart the two choices were (on
`--backend`, compiled as train.measure does). Writes demo/smollm2-llama-cpp.json.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import numpy as np

from dflash_ir import demo
from dflash_ir.artifact import compile_pair, load_compiled

from . import chat_prompts
from .measure import ROOT

THREADS = 2
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def speculative_stats(log: str) -> dict:
    """llama-speculative-simple's closing figures (its stderr)."""
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    if not (decoded and drafted and accepted):
        raise ValueError(f"llama-speculative-simple printed no statistics:\n{log[-2000:]}")
    return {"tokens": int(decoded[1]), "decode_tps": float(decoded[3]),
            "drafted": int(drafted[1]), "accepted": int(accepted[1])}


def eval_tps(log: str) -> float:
    """Decode tokens/s from llama.cpp's `eval time` performance line (its stderr)."""
    found = re.search(r"\beval time =.*?([\d.]+) tokens per second", log.replace("prompt eval time", "prompt"))
    if not found:
        raise ValueError(f"llama-completion printed no eval time:\n{log[-2000:]}")
    return float(found[1])


def generated_text(stdout: str, prompt: str) -> str:
    """What follows the echoed prompt, colours and the closing blank lines removed."""
    text = _ANSI.sub("", stdout)
    start = text.find(prompt)
    if start < 0:
        raise ValueError("llama.cpp's output does not echo the prompt")
    return text[start + len(prompt):].rstrip("\n")


def first_difference(engine, prompt_ids: list[int], ours: list[int], theirs: list[int]) -> dict:
    """Where two greedy continuations of a prompt part: the token index and how much higher our
    target's logit for our token is than for theirs there (a near-tie when small); {} if one
    continuation is the start of the other."""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if at is None:
        return {}
    engine.target.reset()
    logits = np.asarray(engine.target.prefill(prompt_ids + ours[:at]).logits)[-1]
    return {"first_difference": at, "logit_margin": round(float(logits[ours[at]] - logits[theirs[at]]), 4)}


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.llama_cpp_dflash", description=__doc__.splitlines()[0])
    p.add_argument("--bin", type=Path, required=True, help="folder with llama.cpp's binaries")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--prompts", type=int, default=0, help="the first K held-out prompts (0: all)")
    p.add_argument("--backend", default="opencl", help="where our logits are computed (default opencl)")
    args = p.parse_args(argv)
    target, draft = demo.pair_files(demo.PAIRS["smollm2"])
    engine = load_compiled(compile_pair(target, draft, out=ROOT / "build" / f"measure-smollm2-{args.backend}",
                                        backend=args.backend, n_ctx=demo.PAIRS["smollm2"].n_ctx), measure_costs=False)
    tokenizer, template = engine.tokenizer, engine.chat_template
    ours = {row["prompt"]: row for row in json.loads((demo.DEMO_DIR / "smollm2-measurements.json").read_text())["prompts"]}
    eos_pieces = [tokenizer.decode([i]) for i in sorted(tokenizer.eos_ids)]  # ours end with one, llama.cpp's not
    questions = chat_prompts.split()["held_out"]
    rows = []
    for question in questions[:args.prompts or None]:
        prompt = template.render([{"role": "user", "content": question}], add_generation_prompt=True, enable_thinking=False)
        ids = tokenizer.encode(prompt, parse_special=True)
        theirs_ids = json.loads(_run([str(args.bin / "llama-tokenize"), "-m", str(target), "-p", prompt, "--ids",
                                      "--log-disable"]).stdout.strip().splitlines()[-1])
        common = ["-m", str(target), "-p", prompt, "-n", str(args.n_predict), "--temp", "0", "-t", str(THREADS),
                  "-c", "1024"]
        spec = _run([str(args.bin / "llama-speculative-simple"), *common, "-md", str(draft), "--spec-type", "draft-dflash",
                     "--spec-draft-n-max", "15", "-td", str(THREADS)])
        plain = _run([str(args.bin / "llama-completion"), *common, "-no-cnv"])
        text, stats = generated_text(spec.stdout, prompt), speculative_stats(spec.stderr)
        reference = ours[question]["text"]
        for piece in eos_pieces:
            reference = reference.removesuffix(piece)
        n = min(len(text), len(reference))
        row = {"prompt": question, "prompt_ids_equal": theirs_ids == ids, **stats,
               "tau": round(stats["tokens"] / (stats["tokens"] - stats["accepted"]), 2),  # tokens per round
               "target_decode_tps": eval_tps(plain.stderr), "text_equal_ours": text[:n] == reference[:n],
               **first_difference(engine, ids, tokenizer.encode(reference, parse_special=True),
                                  tokenizer.encode(text, parse_special=True)),
               "text": text}
        rows.append(row)
        print(f"{question[:56]:56s} ids equal {row['prompt_ids_equal']}  text equal {row['text_equal_ours']}  "
              f"accepted {stats['accepted']}/{stats['drafted']}  tok/s dflash {stats['decode_tps']:.1f} "
              f"target {row['target_decode_tps']:.1f}", flush=True)
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    margins = [r["logit_margin"] for r in rows if "logit_margin" in r]
    version = _run([str(args.bin / "llama-completion"), "--version"]).stderr.strip().splitlines()[0]
    summary = {"llama_cpp": version, "n_predict": args.n_predict, "threads": THREADS,
               "prompts": len(rows), "prompt_ids_equal": sum(r["prompt_ids_equal"] for r in rows),
               "text_equal_ours": sum(r["text_equal_ours"] for r in rows),
               "logit_margin_at_first_difference": {"min": min(margins, default=None), "median":
                                                    float(np.median(margins)) if margins else None,
                                                    "max": max(margins, default=None)},
               "drafted": drafted, "accepted": accepted,
               "dflash_decode_tps": round(sum(r["tokens"] for r in rows) / sum(r["tokens"] / r["decode_tps"] for r in rows), 1),
               "target_decode_tps": round(len(rows) / sum(1 / r["target_decode_tps"] for r in rows), 1),
               "rows": rows}
    out = demo.DEMO_DIR / "smollm2-llama-cpp.json"
    out.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
