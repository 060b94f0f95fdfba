"""A benchmark run's results as JSON (everything), a markdown table (what to read) and PNG
plots (throughput per backend, fraction of roofline per kernel, speculative speed-up vs tau)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .scale import decode_against_peer


@dataclass
class Results:
    machine: dict[str, Any] = field(default_factory=dict)
    backends: dict[str, dict[str, Any]] = field(default_factory=dict)   # name -> device / skipped reason
    limits: list[dict[str, Any]] = field(default_factory=list)
    kernels: list[dict[str, Any]] = field(default_factory=list)
    e2e: list[dict[str, Any]] = field(default_factory=list)
    costs: list[dict[str, Any]] = field(default_factory=list)  # measured round costs per backend and model
    tau: list[dict[str, Any]] = field(default_factory=list)    # the scripted-draft sweep
    profile: list[dict[str, Any]] = field(default_factory=list)  # per-kernel time of a decode, verify, draft block
    serve: list[dict[str, Any]] = field(default_factory=list)  # dflash-serve's scheduler, batched or not
    peer: list[dict[str, Any]] = field(default_factory=list)
    scale: list[dict[str, Any]] = field(default_factory=list)  # compile, load, memory, speed per process
    bursts: list[dict[str, Any]] = field(default_factory=list)  # decode in turns with llama.cpp, both loaded
    failures: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def bandwidth(self, backend: str) -> float | None:
        """What the backend's device sustains: its own STREAM figure, and for a backend on the
        host CPU the host's too when that is higher (a kernel there can reach what memcpy
        reaches, however well the backend's own stream kernels vectorise)."""
        by = {row["backend"]: max(row["copy_gbs"], row["triad_gbs"]) for row in self.limits}
        on_host = self.backends.get(backend, {}).get("cpu", False)
        figures = [by[name] for name in ([backend] + (["host"] if on_host else [])) if name in by]
        return max(figures) if figures else None


def _steps(row: dict) -> str:
    return f"{row['verify16_steps']:.2f}" if row.get("verify16_steps") is not None else ""


def _pct(x: float | None) -> str:
    return "" if x is None or math.isnan(x) else f"{x:.0%}"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def scale_line(row) -> str:
    """One scale figure set on a line (the CLI's and the table's words)."""
    compiled = f"compile {row.compile_s:6.1f} s  " if row.compile_s is not None else ""
    need = f" ({row.rss_over_need:.2f}x files + states)" if row.rss_over_need is not None else ""
    return (f"{compiled}load cold {row.cold_load_s:6.1f} s warm {row.warm_load_s:6.1f} s  peak RSS "
            f"{_gb(row.peak_rss_bytes)} GB{need}, files {_gb(row.file_bytes)} GB  prefill {row.prefill_tps:7.2f} "
            f"tok/s  decode {row.decode_tps:6.2f} tok/s  verify-16 = {row.verify16_steps:.2f} decode steps")


def markdown(r: Results) -> str:
    out = ["# dflash-bench", "", "Machine: " + ", ".join(f"{k} {v}" for k, v in r.machine.items()), ""]
    out += ["## Backends", "", _table(["backend", "device"], [[n, b.get("device") or f"skipped: {b.get('skipped')}"]
                                                           for n, b in r.backends.items()]), ""]
    if r.limits:
        out += ["## Limits (measured in this run)", "", _table(
            ["through", "copy GB/s", "triad GB/s", "f32 GEMM GFLOP/s"],
            [[l["backend"], f"{l['copy_gbs']:.1f}", f"{l['triad_gbs']:.1f}", f"{l['gemm_gflops']:.1f}"] for l in r.limits]), ""]
    if r.kernels:
        out += ["## Kernels", "", "GB/s is the minimum traffic of one call over its median time; % bw is that over the "
                "bandwidth its device sustains: the backend's own copy/triad, or the host's when the backend runs on "
                "the host CPU and that is higher.", "",
                _table(["kernel", "backend", "ms", "GB/s", "% bw", "GFLOP/s"],
                       [[k["case"], k["backend"], f"{k['ms']:.3f}", f"{k['gbs']:.2f}", _pct(k.get("fraction_bw")),
                         f"{k['gflops']:.1f}"] for k in r.kernels]), ""]
    if r.e2e or r.peer:
        rows = [[e["model"], e["backend"], e["prompt_tokens"], e["generated_tokens"], f"{e['prefill_tps']:.1f}",
                 f"{e['decode_tps']:.1f}", f"{e['speculative_tps']:.1f}", f"{e['tau']:.2f}", f"{e['speedup']:.2f}x",
                 f"{e['adaptive_tps']:.1f}", f"{e['adaptive_speedup']:.2f}x", _steps(e)] for e in r.e2e]
        rows += [[p["model"], p["engine"] + f" ({p['threads']} threads)", p["prompt_tokens"], p["generated_tokens"],
                  f"{p['prefill_tps']:.1f}", f"{p['decode_tps']:.1f}", "", "", "", "", "", _steps(p)] for p in r.peer]
        out += ["## End to end (greedy)", "", "decode = target-only; speculative = 15 proposals every round; "
                "cost-aware = the length the engine chooses from its measured costs; speculative output was checked "
                "equal to target-only output. A slow backend generates fewer tokens (what fits in about a minute). "
                "verify-16 = one 16-row verify (llama.cpp: a 16-token batch with every row's logits) in decode steps.",
                "", _table(["model", "engine", "prompt", "generated", "prefill tok/s", "decode tok/s",
                            "speculative tok/s", "tau", "spec/decode", "cost-aware tok/s", "cost-aware/decode",
                            "verify-16 (decode steps)"], rows), ""]
        matches = [f"{p['model']}: llama.cpp's greedy tokens equal ours ({p['compared_with']}) for "
                   f"{p['matching_tokens']}/{p['generated_tokens']}"
                   for p in r.peer if "matching_tokens" in p]
        out += [f"- {m}" for m in matches] + ([""] if matches else [])
    if r.costs:
        out += ["## Round costs (measured at load)", "", _table(
            ["model", "backend", "decode step ms", "draft block ms", "verify ms for k = 1..16 rows"],
            [[c["model"], c["backend"], f"{c['decode_ms']:.2f}", f"{c['draft_ms']:.2f}",
              " ".join(f"{v:.1f}" for v in c["verify_ms"])] for c in r.costs]), ""]
    if r.tau:
        out += ["## Speed-up vs tau (scripted draft)", "", "The draft network runs; its proposals are the target's "
                "own greedy tokens, right for tau-1 positions per block. Speed-up over target-only decoding with 15 "
                "proposals every round and with the cost-aware length; lengths: proposals verified per step "
                "(0 = a decode step) -> steps.", "",
                _table(["model", "backend", "tau", "tokens", "decode tok/s", "15 proposals", "cost-aware", "lengths"],
                       [[t["model"], t["backend"], t["tau"], t["tokens"], f"{t['decode_tps']:.1f}",
                         f"{t['fixed_speedup']:.2f}x", f"{t['adaptive_speedup']:.2f}x", t["lengths"]]
                        for t in r.tau]), ""]
    if r.profile:
        out += ["## Where the time goes", "", "Each launch of one call priced in place (what the call's first k launches cost over its "
                "first k-1), summed per kernel family; launches = the replay of the whole list, call = the call as "
                "generation runs it (the difference is the host's work per call).", "",
                _table(["model", "backend", "call", "call ms", "launches ms", "launches", "costliest families (ms)"],
                       [[p["model"], p["backend"], p["call"], f"{p['ms']:.3f}", f"{p['launch_ms']:.3f}", p["launches"],
                         ", ".join(f"{f['family']} x{f['launches']} {f['ms']:.3f}" for f in p["families"][:5])]
                        for p in r.profile]), ""]
    if r.serve:
        out += ["## dflash-serve: concurrent requests", "", "Aggregate tokens/s of 1, 2 and 4 requests at once "
                "through the server's scheduler (one slot each, n_max proposals every round), the busy slots' "
                "verify blocks in one batched target pass or each in a pass of its own.", "",
                _table(["model", "backend", "clients", "verify", "tokens", "tok/s", "verify passes / blocks"],
                       [[p["model"], p["backend"], p["clients"], "batched" if p["batched"] else "one by one",
                         p["tokens"], f"{p['tps']:.1f}", f"{p['verify_passes']} / {p['verified_blocks']}"]
                        for p in r.serve]), ""]
    if r.scale:
        out += ["## Scale: compile, load, memory and speed (each in a process of its own)", "",
                "cold = the GGUFs dropped from the page cache first; warm = the next process, which also gives the "
                "speed figures and the peak RSS (VmHWM: llama.cpp's counts its mapped GGUF). states = KV caches + "
                "recurrent states as dflash-ir prints them before allocating.", "",
                _table(["model", "engine", "files GB", "states GB", "compile s", "cold load s", "warm load s",
                        "peak RSS GB", "RSS / (files + states)", "prefill tok/s", "decode tok/s",
                        "verify-16 (decode steps)"],
                       [[x["model"], x["engine"], _gb(x["file_bytes"]),
                         _gb(x["state_bytes"]) if x["state_bytes"] is not None else "",
                         f"{x['compile_s']:.1f}" if x["compile_s"] is not None else "", f"{x['cold_load_s']:.1f}",
                         f"{x['warm_load_s']:.1f}", _gb(x["peak_rss_bytes"]),
                         f"{x['rss_over_need']:.2f}" if x["rss_over_need"] is not None else "",
                         f"{x['prefill_tps']:.2f}", f"{x['decode_tps']:.2f}", _steps(x)] for x in r.scale]), ""]
        against = [s for s in decode_against_peer(r.scale) if s["ratios"]]
        if against:
            out += ["Decode against llama.cpp's in the same alternation (the engines alternate, `--repeats`):", "",
                    _table(["model", "engine", "decode tok/s", "llama.cpp decode tok/s", "ratios", "median ratio"],
                           [[s["model"], s["engine"], ", ".join(f"{x:.2f}" for x in s["decode_tps"]),
                             ", ".join(f"{x:.2f}" for x in s["peer_decode_tps"]),
                             ", ".join(f"{x:.2f}" for x in s["ratios"]), f"{s['median_ratio']:.2f}"]
                            for s in against]), ""]
    if r.bursts:
        out += ["Decode in turns with llama.cpp, both engines loaded at once (`--bursts`; the order swapped every "
                "round):", "",
                _table(["model", "engine", "tokens a round", "decode tok/s", "llama.cpp decode tok/s", "ratios",
                        "median ratio"],
                       [[d["model"], d["engine"], d["tokens"], ", ".join(f"{x:.2f}" for x in d["decode_tps"]),
                         ", ".join(f"{x:.2f}" for x in d["peer_decode_tps"]),
                         ", ".join(f"{x:.2f}" for x in d["ratios"]), f"{d['median_ratio']:.2f}"] for d in r.bursts]),
                ""]
    if r.failures:
        out += ["## Failures", ""] + [f"- {f['where']}: {f['error']}" for f in r.failures] + [""]
    return "\n".join(out)


def write_plots(r: Results, folder: Path) -> list[Path]:
    """PNG plots; needs matplotlib (a dev/bench dependency): raises ImportError naming it."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib (pip install matplotlib, or the bench extra)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name: str) -> None:
        path = folder / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if r.e2e or r.peer:
        labels, decode, spec = [], [], []
        for e in r.e2e:
            labels.append(f"{e['model']}\n{e['backend']}")
            decode.append(e["decode_tps"])
            spec.append(e["speculative_tps"])
        for p in r.peer:
            labels.append(f"{p['model']}\nllama.cpp")
            decode.append(p["decode_tps"])
            spec.append(0.0)
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 4))
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], decode, 0.4, label="target-only decode")
        ax.bar([x + 0.2 for x in xs], spec, 0.4, label="speculative (DFlash)")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s")
        ax.set_title("Throughput per backend")
        ax.legend()
        save(fig, "throughput.png")
    if r.kernels:
        cases = list(dict.fromkeys(k["case"] for k in r.kernels))
        backends = list(dict.fromkeys(k["backend"] for k in r.kernels))
        fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(cases) * max(1, len(backends)) / 2), 4.5))
        width = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            got = {k["case"]: k.get("fraction_bw") or 0.0 for k in r.kernels if k["backend"] == b}
            ax.bar([c + i * width for c in range(len(cases))], [got.get(c, 0.0) for c in cases], width, label=b)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], cases, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("fraction of measured bandwidth")
        ax.set_title("Kernels against the roofline (memory bound)")
        ax.legend()
        save(fig, "roofline.png")
    if r.e2e or r.tau:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for e in r.e2e:
            ax.scatter(e["tau"], e["speedup"], label=f"{e['model']} / {e['backend']} (its draft)")
        for model, backend in dict.fromkeys((t["model"], t["backend"]) for t in r.tau):
            sweep = [t for t in r.tau if (t["model"], t["backend"]) == (model, backend)]
            taus = [t["tau"] for t in sweep]
            line, = ax.plot(taus, [t["adaptive_speedup"] for t in sweep], marker="o", ms=3,
                            label=f"{model} / {backend}: cost-aware length")
            ax.plot(taus, [t["fixed_speedup"] for t in sweep], ls="--", color=line.get_color(),
                    label=f"{model} / {backend}: 15 proposals")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(0.95, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("tau (tokens per verify round)")
        ax.set_ylabel("speculative / target-only tokens/s")
        ax.set_title("Speculative speed-up vs tau")
        ax.legend(fontsize=7)
        save(fig, "speedup_vs_tau.png")
    return written


def write_all(r: Results, folder: Path, *, say=print) -> list[Path]:
    """Writes the JSON and markdown always; the plots when matplotlib is there (else says so:
    a GPU machine may lack it, and its numbers still count)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(r.to_dict(), indent=1, default=str))
    (folder / "results.md").write_text(markdown(r))
    try:
        plots = write_plots(r, folder)
    except ImportError as e:
        say(f"dflash-bench: no plots: {e}")
        plots = []
    return [folder / "results.json", folder / "results.md", *plots]
