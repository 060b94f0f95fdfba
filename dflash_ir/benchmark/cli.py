"""`dflash-bench`: which backend, how fast, how close to the hardware limit, and how much
DFlash buys. Runs the chosen suites on every backend that can run here (the others are
listed with the reason), prints each figure as it comes, and writes results.json,
results.md and PNG plots to --out.

    dflash-bench                                  every suite, backend and model (minutes)
    dflash-bench --suites kernels -b opencl       one suite on one backend
    dflash-bench --suites tau -b opencl --models synthetic --taus 1,6,16
                                                  speculative tokens/s at chosen acceptance lengths
    dflash-bench --suites serve -b opencl --models demo
                                                  dflash-serve's aggregate tokens/s, 1/2/4 clients,
                                                  verify blocks batched or not
    dflash-bench --suites scale -b opencl --models qwen35-9b
                                                  a real-size model (generated once, ~10 GB):
                                                  compile, cold/warm load, peak RSS, speed, and
                                                  llama.cpp's on the same file
    dflash-bench --suites scale -b opencl --models qwen35-9b-q4_k_m --bursts 12
                                                  then both engines loaded at once, decoding in
                                                  turns: the ratio a drifting machine still gives
    dflash-bench --suites profile -b cuda --models synthetic
                                                  where a decode step, a verify and a draft
                                                  block spend their time, kernel by kernel
    dflash-bench --suites e2e -b opencl --numerics exact,q8
                                                  each pair compiled in both numerics modes,
                                                  the q8 runs labelled opencl/q8
    dflash-bench --quick                          small shapes and models: a smoke run
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

from dflash_ir import __version__
from dflash_ir.backends.base import get_backend, known_backends
from dflash_ir.passes.quantize_activations import NUMERICS

from . import e2e as e2e_suite
from . import kernels as kernel_suite
from . import limits as limit_suite
from . import models as model_suite
from . import peer as peer_suite
from . import profile as profile_suite
from . import scale as scale_suite
from . import serve as serve_suite
from . import tau as tau_suite
from .measure import available_memory, time_calls
from .report import Results, scale_line, write_all

SUITES = ("limits", "kernels", "e2e", "tau", "profile", "serve", "peer", "scale")
MODELS = ("demo", "synthetic")  # the default; model_suite.REAL_MODELS when named


def _machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": str(os.cpu_count()), "python": platform.python_version(), "numpy": np.__version__,
            "dflash-ir": __version__, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


class Bench:
    def __init__(self, args, work: Path):
        self.args = args
        self.work = work
        self.results = Results(machine=_machine())
        self.budget = 0.2 if args.quick else args.budget

    def say(self, msg: str) -> None:
        print(msg, flush=True)

    def attempt(self, where: str, fn, skips: tuple[type[Exception], ...] = (), shown: str = ""):
        """Run one measurement; a failure is recorded and reported, and the run goes on. An
        exception of `skips` says the measurement does not apply there: `shown` is said to be
        skipped, with the reason, and nothing is recorded."""
        try:
            return fn()
        except skips as e:
            self.say(f"  {shown}: skipped ({e})")
            return None
        except Exception as e:  # one broken backend must not hide the other results
            self.results.failures.append({"where": where, "error": f"{type(e).__name__}: {e}"})
            self.say(f"  FAILED {where}: {type(e).__name__}: {e}")
            if self.args.verbose:
                traceback.print_exc()
            return None

    def backends(self) -> list:
        names = known_backends() if self.args.backends == "all" else self.args.backends.split(",")
        unknown = sorted(set(names) - set(known_backends()))
        if unknown:
            raise SystemExit(f"dflash-bench: unknown backend(s) {', '.join(unknown)}; known: {', '.join(known_backends())}")
        ready = []
        for name in names:
            backend = get_backend(name)
            try:
                reason = backend.unavailable_reason()
                entry = {"skipped": reason} if reason else {"device": backend.device_description(),
                                                            "cpu": backend.device_is_cpu()}
            except Exception as e:  # a backend that cannot even say what it runs on is reported, not fatal
                reason = f"{type(e).__name__}: {e}"
                entry = {"skipped": reason}
                self.results.failures.append({"where": f"backend/{name}", "error": reason})
            self.results.backends[name] = entry
            self.say(f"backend {name}: " + (f"skipped ({reason})" if reason else entry["device"]))
            if not reason:
                ready.append(backend)
        return ready

    def runs(self, backends) -> list[tuple[str, str, str]]:
        """(backend, numerics, label) for each compiled configuration the engine suites measure:
        the --numerics modes, else the backend's default one."""
        return [(b.name, numerics, e2e_suite.run_label(b.name, numerics))
                for b in backends for numerics in self.args.numerics or (b.default_numerics(),)]

    def limits(self, backends) -> None:
        elements, gemm = (1 << 20, 256) if self.args.quick else (1 << 24, 1024)
        self.say("\n== limits ==")
        rows = [self.attempt("limits/host", lambda: limit_suite.host_limits(elements=elements, gemm=gemm,
                                                                             budget_s=self.budget))]
        for b in backends:
            rows.append(self.attempt(f"limits/{b.name}", lambda b=b: limit_suite.measure_limits(
                b, self.work / "limits" / b.name, elements=elements, gemm=gemm, budget_s=self.budget)))
        for row in filter(None, rows):
            self.results.limits.append(row.__dict__)
            self.say(f"  {row.backend:12s} copy {row.copy_gbs:7.2f} GB/s  triad {row.triad_gbs:7.2f} GB/s  "
                     f"f32 GEMM {row.gemm_gflops:8.1f} GFLOP/s")

    def kernels(self, backends) -> None:
        self.say("\n== kernels ==")
        by_name = {b.name: b for b in backends}
        for make in kernel_suite.default_cases(quick=self.args.quick):
            case = make()
            for name, numerics, label in self.runs(backends):
                def measure(b=by_name[name], numerics=numerics, label=label, case=case):
                    folder = self.work / "kernels" / label.replace("/", "-") / case.graph.name
                    timing = time_calls(case.runner(b, folder, numerics), budget_s=self.budget)
                    bandwidth = self.results.bandwidth(b.name)
                    row = {"case": case.name, "family": case.family, "backend": label, "ms": timing.seconds * 1e3,
                           "calls": timing.calls, "bytes": case.nbytes, "flops": case.flops,
                           "gbs": timing.rate(case.nbytes) / 1e9, "gflops": timing.rate(case.flops) / 1e9}
                    row["fraction_bw"] = row["gbs"] / bandwidth if bandwidth else None
                    return row
                row = self.attempt(f"kernels/{label}/{case.name}", measure)
                if row:
                    self.results.kernels.append(row)
                    share = f" ({row['fraction_bw']:.0%} of bw)" if row["fraction_bw"] else ""
                    self.say(f"  {case.name:34s} {label:13s} {row['ms']:9.3f} ms {row['gbs']:7.2f} GB/s{share}"
                             f" {row['gflops']:8.1f} GFLOP/s")
            del case

    def models(self) -> list:
        chosen = []
        for name in self.args.models.split(","):
            if name == "demo":
                chosen.append(self.attempt("models/demo", model_suite.demo_model))
            elif name == "synthetic":
                chosen.append(self.attempt("models/synthetic", lambda: model_suite.synthetic_model(
                    small=self.args.quick, progress=self.say)))
            elif name in model_suite.REAL_MODELS:
                chosen.append(self.attempt(f"models/{name}", lambda name=name: model_suite.real_model(
                    name, progress=self.say)))
            else:
                known = ", ".join((*MODELS, *model_suite.REAL_MODELS))
                raise SystemExit(f"dflash-bench: unknown model {name!r}; known: {known}")
        return [m for m in chosen if m]

    def end_to_end(self, backends, models) -> None:
        self.say("\n== end to end ==")
        for m in models:
            self.say(f"  model {m.name}: {m.description}")
            for backend, numerics, label in self.runs(backends):
                row = self.attempt(f"e2e/{label}/{m.name}", lambda backend=backend, numerics=numerics:
                                   e2e_suite.run_end_to_end(backend, m, self.work / "e2e",
                                                            max_tokens=self.args.max_tokens, numerics=numerics))
                if row:
                    self.results.e2e.append(row.to_dict())
                    fewer = (f"  [{row.generated_tokens} tokens: more would take over a minute]"
                             if row.generated_tokens < self.args.max_tokens else "")
                    self.say(f"  {m.name:10s} {label:10s} prefill {row.prefill_tps:8.1f} tok/s  decode "
                             f"{row.decode_tps:7.1f} tok/s  speculative {row.speculative_tps:7.1f} tok/s  "
                             f"tau {row.tau:5.2f}  ({row.speedup:.2f}x; cost-aware {row.adaptive_speedup:.2f}x)  "
                             f"verify-16 = {row.verify16_steps:.2f} decode steps{fewer}")

    def tau_sweep(self, backends, models) -> None:
        self.say("\n== speed-up vs tau (scripted draft) ==")
        for m in models:
            for backend, numerics, label in self.runs(backends):
                got = self.attempt(f"tau/{label}/{m.name}", lambda backend=backend, numerics=numerics:
                                   tau_suite.run_tau_sweep(backend, m, self.work / "e2e", taus=self.args.taus,
                                                           max_tokens=self.args.max_tokens,
                                                           repeats=1 if self.args.quick else 3, numerics=numerics),
                                   skips=(tau_suite.TooSlow,), shown=f"{m.name} / {label}")
                if not got:
                    continue
                costs, points = got
                self.results.costs.append({"backend": label, "model": m.name, "decode_ms": costs.decode * 1e3,
                                           "draft_ms": costs.draft * 1e3,
                                           "verify_ms": [v * 1e3 for v in costs.verify]})
                self.say(f"  {m.name} / {label}: {costs.summary()}")
                for p in points:
                    self.results.tau.append(p.to_dict())
                    self.say(f"  {m.name:10s} {label:10s} tau {p.tau:2d}: decode {p.decode_tps:7.1f} tok/s  "
                             f"15 proposals {p.fixed_tps:7.1f} ({p.fixed_speedup:.2f}x)  cost-aware "
                             f"{p.adaptive_tps:7.1f} ({p.adaptive_speedup:.2f}x)  lengths {p.lengths}")

    def profile(self, backends, models) -> None:
        self.say("\n== where the time goes (each launch priced in place) ==")
        for m in models:
            for backend, numerics, label in self.runs(backends):
                calls = self.attempt(f"profile/{label}/{m.name}", lambda backend=backend, numerics=numerics:
                                     profile_suite.run_profile(backend, m, self.work / "e2e", numerics=numerics,
                                                               repeats=1 if self.args.quick else 3),
                                     skips=(profile_suite.NoLaunches,), shown=f"{m.name} / {label}")
                for call in calls or ():
                    self.results.profile.append(call.to_dict())
                    for line in profile_suite.summary(call):
                        self.say(line)

    def serve(self, backends, models) -> None:
        self.say("\n== serve: concurrent requests, verify blocks batched or one pass each ==")
        for m in models:
            for backend, numerics, label in self.runs(backends):
                points = self.attempt(f"serve/{label}/{m.name}", lambda backend=backend, numerics=numerics:
                                      serve_suite.run_serve(backend, m, self.work / "e2e", max_tokens=self.args.max_tokens,
                                                            repeats=1 if self.args.quick else 3, numerics=numerics))
                for p in points or ():
                    self.results.serve.append(p.to_dict())
                    mode = "batched" if p.batched else "one by one"
                    self.say(f"  {m.name:10s} {label:10s} {p.clients} clients {mode:10s} {p.tps:8.1f} tok/s  "
                             f"({p.verify_passes} verify passes for {p.verified_blocks} blocks)")

    def peer(self, models) -> None:
        self.say("\n== peer: llama.cpp ==")
        reason = peer_suite.peer_unavailable()
        if reason:
            self.results.backends["llama.cpp"] = {"skipped": reason}
            self.say(f"  skipped: {reason}")
            return
        ours: dict[str, dict] = {}  # per model, our longest run (a slow backend's is time-boxed)
        for e in self.results.e2e:
            if len(e["tokens"]) > len(ours.get(e["model"], {}).get("tokens", ())):
                ours[e["model"]] = e
        for m in models:
            if m.name not in ours:
                self.say(f"  {m.name}: no end-to-end run of ours to compare with (run the e2e suite too)")
                continue
            mine = ours[m.name]
            row = self.attempt(f"peer/{m.name}", lambda: peer_suite.run_llama_cpp(
                m.name, m.target, mine["prompt_ids"], len(mine["tokens"])))
            if row:
                d = row.to_dict()
                d["compared_with"] = mine["backend"]
                d["matching_tokens"] = next((i for i, (a, b) in enumerate(zip(row.tokens, mine["tokens"])) if a != b),
                                            min(len(row.tokens), len(mine["tokens"])))
                self.results.peer.append(d)
                self.say(f"  {m.name:10s} {row.engine} ({row.threads} threads) prefill {row.prefill_tps:8.1f} tok/s"
                         f"  decode {row.decode_tps:7.1f} tok/s  verify-16 = {row.verify16_steps:.2f} decode steps  "
                         f"greedy tokens equal ours ({mine['backend']}): {d['matching_tokens']}/{row.generated_tokens}")

    def scale(self, backends, models) -> None:
        self.say("\n== scale: compile, load, memory and speed, each in a process of its own ==")
        peer = peer_suite.peer_unavailable()
        if peer:
            self.say(f"  llama.cpp skipped: {peer}")
        for m in models:
            self.say(f"  model {m.name}: {m.description}")
            n = self.args.max_tokens
            runs = [(label, lambda backend=backend, numerics=numerics: scale_suite.run_scale(
                        backend, m, self.work / "scale", max_tokens=n, numerics=numerics))
                    for backend, numerics, label in self.runs(backends)]
            runs += [] if peer else [("llama.cpp", lambda: scale_suite.run_llama_cpp_scale(m, max_tokens=n))]
            rows = []
            for repeat in range(self.args.repeats):  # the engines alternate, each run in processes of its own
                for engine, run in runs:
                    row = self.attempt(f"scale/{engine}/{m.name}", run)
                    if row:
                        rows.append(row.to_dict() | {"repeat": repeat})
                        self.say(f"  {m.name:10s} {engine:10s} {scale_line(row)}")
            self.results.scale += rows
            for s in scale_suite.decode_against_peer(rows):
                if s["ratios"]:
                    self.say(f"  {m.name:10s} {s['engine']:10s} decode / llama.cpp's, same alternation: "
                             + ", ".join(f"{x:.2f}" for x in s["ratios"]) + f" (median {s['median_ratio']:.2f})")
            if self.args.bursts and not peer:
                self.bursts(backends, m, rows)

    def bursts(self, backends, m, rows: list[dict]) -> None:
        """--bursts: our decode and llama.cpp's in turns, both loaded at once (scale.decode_bursts),
        where the two peak resident sets this run measured fit in the memory available."""
        for backend, numerics, label in self.runs(backends):
            skip = scale_suite.bursts_unfit(rows, label, available_memory())
            if skip:
                self.say(f"  {m.name:10s} {label:10s} decode bursts skipped: {skip}")
                continue
            n = self.args.max_tokens
            d = self.attempt(f"bursts/{label}/{m.name}", lambda: scale_suite.decode_bursts(
                backend, m, self.work / "scale", rounds=self.args.bursts, tokens=n, numerics=numerics))
            if d:
                self.results.bursts.append(d)
                self.say(f"  {m.name:10s} {label:10s} decode / llama.cpp's, {self.args.bursts} rounds of {n} tokens "
                         f"in turns: " + ", ".join(f"{x:.2f}" for x in d["ratios"])
                         + f" (median {d['median_ratio']:.2f})")

    def run(self) -> Results:
        suites = self.args.suites.split(",")
        unknown = set(suites) - set(SUITES)
        if unknown:
            raise SystemExit(f"dflash-bench: unknown suite(s) {', '.join(sorted(unknown))}; known: {', '.join(SUITES)}")
        backends = self.backends()
        if "limits" in suites:
            self.limits(backends)
        if "kernels" in suites:
            self.kernels(backends)
        if {"e2e", "tau", "profile", "serve", "peer", "scale"} & set(suites):
            models = self.models()
            if "e2e" in suites:
                self.end_to_end(backends, models)
            if "tau" in suites:
                self.tau_sweep(backends, models)
            if "profile" in suites:
                self.profile(backends, models)
            if "serve" in suites:
                self.serve(backends, models)
            if "peer" in suites:
                self.peer(models)
            if "scale" in suites:
                self.scale(backends, models)
        return self.results


def _taus(text: str) -> tuple[int, ...]:
    """`1,6,16` or `1-16` (or a mix) -> the acceptance lengths, each in 1..16."""
    taus = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        taus += range(int(first), int(last or first) + 1)
    if not taus or not all(1 <= t <= 16 for t in taus):
        raise argparse.ArgumentTypeError(f"acceptance lengths must lie in 1..16, got {text!r}")
    return tuple(taus)


def _numerics(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(text.split(",")))
    unknown = [m for m in modes if m not in NUMERICS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown numerics mode(s) {', '.join(unknown)}; known: {', '.join(NUMERICS)}")
    return modes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("-b", "--backends", default="all", help="comma-separated backend names, or all (default)")
    p.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated subset of {','.join(SUITES)}")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--quick", action="store_true", help="small shapes and models, short timing: a smoke run")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per kernel figure (default 1)")
    p.add_argument("--numerics", type=_numerics, default=None,
                   help="comma-separated numerics modes the e2e, tau, serve and scale suites compile each pair in "
                        "(exact, q8; default: each backend's, as dflash-compile's); runs other than exact are "
                        "labelled BACKEND/MODE")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens generated per end-to-end or scale run (default 32)")
    p.add_argument("--repeats", type=int, default=1,
                   help="times the scale suite runs each engine, alternating them (default 1); with llama.cpp, "
                        "each of our decode figures is compared with its own in the same alternation")
    p.add_argument("--bursts", type=int, default=0,
                   help="rounds of the scale suite's decode bursts: after its runs, our engine and llama.cpp "
                        "loaded at once, each decoding --max-tokens tokens in turn, the order swapped each round "
                        "(default 0: none); each round's ratio and their median")
    p.add_argument("--taus", type=_taus, default=tau_suite.TAUS,
                   help="acceptance lengths of the tau suite, e.g. 1,6,16 or 1-16 (default 1-16; --quick: 1,6,16)")
    p.add_argument("-o", "--out", default="bench-results", help="folder for results.json, results.md, *.png")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failed measurements")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, not {args.repeats}")
    if args.bursts < 0:
        p.error(f"--bursts must be 0 or more, not {args.bursts}")
    if args.quick and args.max_tokens == 32:
        args.max_tokens = 16
    if args.quick and args.taus == tau_suite.TAUS:
        args.taus = (1, 6, 16)

    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as work:
        results = Bench(args, Path(work)).run()
    written = write_all(results, Path(args.out))
    print(f"\ndflash-bench: wrote {', '.join(str(w) for w in written)}")
    if results.failures:
        print(f"dflash-bench: {len(results.failures)} measurement(s) failed; see results.md",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
