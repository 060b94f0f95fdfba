"""`--tune`: MetaSchedule on a program's distinct kernels at the row counts that matter, records
kept in a shared cache keyed by target + kernel + rows and reused by every later compile.

MetaSchedule measures static shapes, and a plan's kernels take the token count as an int
(`n_T`): a kernel is tuned at each of ROWS (a decode token; a DFlash verify block), and the
tuned function, specialised to that count, is launched when the call has it (a `when`
condition); other counts keep the untuned kernel. Tuned are the kernels whose only symbol is
the token count (or none), that no hand schedule covers (cpu_schedules.py) and that are not
sequential scans (nothing for MetaSchedule to schedule there).

Builds and measurements run in this process: LocalBuilder and LocalRunner start worker
processes that each import TVM, which on a loaded 2-core machine outlasts their 30 s
timeout. The budget is checked before each tuning run, so a compile may overrun it by one.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from dflash_ir import cache

from .tir import PrimKernel
from .version import PINNED

ROWS = (1, 16)          # token counts tuned: decode, and a verify block of 16
TRIALS = 8              # MetaSchedule trials per kernel and row count
SYMBOL = "n_T"          # the token count's int parameter
FORMAT = 1              # of a cached record: bump when what is stored changes


def cache_dir() -> Path:
    return cache.cache_dir("tuning", "DFLASH_IR_TUNING_CACHE")


@dataclass(frozen=True)
class Tuned:
    """A kernel's schedule tuned at `rows` tokens: the specialised PrimFunc's TVMScript and the
    MetaSchedule records (workload and tuning record lines) it came from."""

    kernel: str
    rows: int
    script: str
    record: dict

    @property
    def name(self) -> str:
        return f"{self.kernel}_rows{self.rows}"


def tunable(kernel: PrimKernel) -> bool:
    return not kernel.sequential and not kernel.cpu_body and set(kernel.ints) <= {SYMBOL}


def _key(config: Mapping, kernel: PrimKernel, rows: int) -> str:
    text = f"tvm {PINNED} format {FORMAT} {json.dumps(dict(config), sort_keys=True)} rows {rows}\n{kernel.script()}"
    return hashlib.sha256(text.encode()).hexdigest()


def tune(config: Mapping, kernels: Mapping[str, PrimKernel], until: float,
         progress: Callable[[str], None] = lambda msg: None) -> tuple[list[Tuned], int]:
    """(the tuned schedules of `kernels`, how many MetaSchedule runs this call made): cached
    records, and new runs (each stored in the cache) started before time.monotonic() `until`."""
    found, runs = [], 0
    for name in sorted(n for n, k in kernels.items() if tunable(k)):
        for rows in ROWS if SYMBOL in kernels[name].ints else (None,):
            path = cache_dir() / f"{_key(config, kernels[name], rows or 0)}.json"
            if not path.is_file():
                if time.monotonic() >= until:
                    continue
                progress(f"tuning {name} at {rows or 'its'} rows ({TRIALS} trials)")
                _store(path, _tune_one(config, kernels[name], rows))
                runs += 1
            record = _load(path)
            if record["script"]:
                found.append(Tuned(name, rows or 0, record["script"], record))
    return found, runs


def _store(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(record))
    partial.replace(path)


def _load(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
        if isinstance(record, dict) and isinstance(record.get("script"), str):
            return record
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    raise ValueError(f"{path}: not a dflash-ir tuning record (damaged?): delete it and tune again")


def _tune_one(config: Mapping, kernel: PrimKernel, rows: int | None) -> dict:
    """MetaSchedule on the kernel (specialised to `rows`): the best schedule found, or an
    empty script when no trial built and ran."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    func = tvm.script.from_source(kernel.script())
    if rows is not None:
        func = func.specialize({p: tvm.tirx.IntImm("int32", rows) for p in func.params if p.name == SYMBOL})
    mod = tvm.IRModule({"main": func})
    target = tvm.target.Target({**config, "num-cores": _cores()})
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dflash-ir-tune-") as work:
        db = ms.tir_integration.tune_tir(mod, target, work, max_trials_global=TRIALS, num_trials_per_iter=4,
                                         strategy="replay-trace", cost_model="random",
                                         builder=_Builder(), runner=_Runner())
        timed = [r for r in db.get_all_tuning_records() if r.run_secs]
        lines = {f: Path(work, f).read_text() for f in ("database_workload.json", "database_tuning_record.json")
                 if Path(work, f).is_file()}
    record = {"kernel": kernel.name, "rows": rows, "target": dict(config), "trials": TRIALS,
              "seconds": round(time.monotonic() - t0, 3), "measured": len(timed), "records": lines}
    for best in sorted(timed, key=lambda r: float(r.run_secs[0])):
        sch = tvm.s_tir.Schedule(func)
        best.trace.apply_to_schedule(sch, remove_postproc=False)
        if agrees(func, sch.mod["main"], target):
            return {**record, "script": sch.mod["main"].script(), "best_s": float(best.run_secs[0])}
    return {**record, "script": "", "best_s": None}


def agrees(func, scheduled, target) -> bool:
    """Whether `scheduled` computes what `func` (unscheduled, static shapes) does, every buffer
    after one call on the same inputs (random floats and bytes, zero ints: valid indices).
    MetaSchedule does not check its candidates: a replayed trace of a 3-row product with an
    odd K computed garbage in about one tuning run in four (2026-12-07)."""
    import numpy as np
    import tvm
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    rng = np.random.default_rng(0)
    inputs = []
    for info in ArgInfo.from_prim_func(func):
        shape, dtype = [int(d) for d in info.shape], str(info.dtype)
        if dtype.startswith("float"):
            inputs.append(rng.standard_normal(shape).astype(dtype))
        elif dtype == "uint8":
            inputs.append(rng.integers(0, 256, shape, dtype=np.uint8))
        else:
            inputs.append(np.zeros(shape, dtype))

    def run(f) -> list:
        lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=target)
        arrays = [tvm.runtime.tensor(a.copy()) for a in inputs]
        lib["main"](*arrays)
        return [a.numpy() for a in arrays]

    return all(np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True) for a, b in zip(run(func), run(scheduled)))


def _cores() -> int:
    return len(os.sched_getaffinity(0))


@functools.cache
def _in_process():
    """MetaSchedule's builder and runner classes, building and measuring in this process (see
    the module docstring)."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.s_tir.meta_schedule.builder.local_builder import default_build, default_export
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner
    from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture, _worker_func

    @derived_object
    class Builder(PyBuilder):
        def build(self, build_inputs):
            out = []
            for b in build_inputs:
                try:
                    out.append(BuilderResult(default_export(default_build(b.mod, b.target, None)), None))
                except Exception as e:  # noqa: BLE001 - a failed candidate is MetaSchedule's to record
                    out.append(BuilderResult(None, f"{type(e).__name__}: {e}"))
            return out

    @derived_object
    class Runner(PyRunner):
        def run(self, runner_inputs):
            config = EvaluatorConfig(number=3, repeat=1, min_repeat_ms=0, enable_cpu_cache_flush=False)
            out = []
            for r in runner_inputs:
                try:
                    costs = _worker_func(None, None, None, config, 1, r.artifact_path, r.device_type,
                                         [a.as_json() for a in r.args_info])
                    out.append(LocalRunnerFuture(res=costs))
                except Exception as e:  # noqa: BLE001 - as above
                    out.append(LocalRunnerFuture(error_message=f"{type(e).__name__}: {e}"))
            return out

    return Builder, Runner


def _Builder():
    return _in_process()[0]()


def _Runner():
    return _in_process()[1]()
