"""`dflash-compile --tune` (backends/tvm/tune.py): MetaSchedule records land in the shared cache
and the artifact, a later compile reuses them without tuning, the tuned specialisation runs
when a call has its token count and computes what the interpreter does."""
import json

import pytest

from kernel_cases import CASES, case_graph, compare

UNSCHEDULED = "matmul_rank3_odd_k_T3"  # no hand schedule (K not a multiple of 32): tunable, 3 rows


def test_tuned_plan_launches_each_specialisation_for_its_rows_only(tvm):
    from dflash_ir.backends.plan import compile_expr
    from dflash_ir.backends.tvm.backend import tuned_plan
    from dflash_ir.backends.tvm.lowering import lower
    from dflash_ir.backends.tvm.tune import Tuned

    plan, kernels = lower(case_graph(CASES["matmul_f16_residual_3_rows"].build()))
    product = next(n for n, k in kernels.items() if k.op == "matmul")
    tuned = [Tuned(product, rows, "", {}) for rows in (1, 16)]
    launches = [l for s in tuned_plan(plan, tuned).steps for l in s.launches]
    for n_T in (1, 3, 16, 40):
        ran = [l.kernel for l in launches if l.when is None or compile_expr(l.when)({"n_T": n_T})]
        want = f"{product}_rows{n_T}" if n_T in (1, 16) else product
        assert [k for k in ran if k.startswith(product)] == [want], n_T
        assert len(ran) == 2  # and the residual add, untouched


def test_untuned_compile_never_starts_metaschedule(tvm, tmp_path, monkeypatch):
    from dflash_ir.backends.tvm import tune

    def refuse(*args):
        raise AssertionError("MetaSchedule started without --tune")

    monkeypatch.setattr(tune, "_tune_one", refuse)
    entry = tvm.compile(case_graph(CASES[UNSCHEDULED].build()), tmp_path)
    assert "tuning" not in entry and not any("_rows" in k for k in entry["kernels"])


def test_tune_is_refused_for_a_backend_that_does_not_tune(tmp_path, capsys):
    from dflash_ir.cli.compile import main

    assert main([str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "art"), "--backend", "opencl", "--tune=5"]) == 1
    assert "--tune: backend opencl does not tune; tvm-llvm does" in capsys.readouterr().err


@pytest.mark.slow
def test_tuning_records_are_written_reused_and_the_tuned_kernel_is_correct(tvm, tmp_path, monkeypatch):
    """One MetaSchedule run (the case's single product at its three rows): cache record and the
    artifact's copy; a second backend compiling the same graph runs no tuning; the tuned
    kernel (launched: the case has that row count) matches the interpreter."""
    from dflash_ir.backends.base import get_backend
    from dflash_ir.backends.tvm import tune

    monkeypatch.setenv("DFLASH_IR_TUNING_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tune, "ROWS", (3,))
    name = UNSCHEDULED
    graph = case_graph(CASES[name].build())

    first = get_backend("tvm-llvm")
    first.tune_s = 600.0
    entry = first.compile(graph, tmp_path / "a")
    assert first.tuning_runs == 1
    (cached,) = (tmp_path / "cache").glob("*.json")
    record = json.loads(cached.read_text())
    assert record["measured"] > 0 and record["script"] and record["records"]["database_tuning_record.json"]
    assert json.loads((tmp_path / "a" / entry["tuning"]).read_text()) == [record]
    launched = {l["kernel"]: l.get("when") for s in entry["plan"]["steps"] for l in s["launches"]}
    assert launched[f"{record['kernel']}_rows3"] == "(n_T == 3)"

    second = get_backend("tvm-llvm")
    second.tune_s = 600.0
    assert second.compile(graph, tmp_path / "b")["tuning"] == entry["tuning"]
    assert second.tuning_runs == 0
    compare(second, name, tmp_path / "c")


def test_damaged_tuning_record_is_named(tvm, tmp_path, monkeypatch):
    from dflash_ir.backends.tvm import tune
    from dflash_ir.backends.tvm.build import host_llvm
    from dflash_ir.backends.tvm.lowering import lower

    monkeypatch.setenv("DFLASH_IR_TUNING_CACHE", str(tmp_path))
    kernels = lower(case_graph(CASES[UNSCHEDULED].build()))[1]
    name = next(n for n, k in kernels.items() if tune.tunable(k))
    damaged = tmp_path / f"{tune._key(host_llvm(), kernels[name], tune.ROWS[0])}.json"
    damaged.write_text("{not json")
    with pytest.raises(ValueError, match=f"{damaged}: not a dflash-ir tuning record"):
        tune.tune(host_llvm(), kernels, 0.0)


def test_a_schedule_is_kept_only_where_it_computes_what_the_kernel_does(tvm):
    """tune.agrees: MetaSchedule does not check its candidates, and one replayed trace of the
    odd-K product computed garbage; a schedule whose outputs differ from the kernel's is refused."""
    import tvm as tvm_module

    from dflash_ir.backends.tvm.build import host_llvm
    from dflash_ir.backends.tvm.lowering import lower
    from dflash_ir.backends.tvm.tune import agrees

    _, kernels = lower(case_graph(CASES[UNSCHEDULED].build()))
    script = next(k for k in kernels.values() if k.op == "matmul").script()
    assert "T.float32(0)" in script

    def func(text):
        f = tvm_module.script.from_source(text)
        return f.specialize({p: tvm_module.tirx.IntImm("int32", 3) for p in f.params if p.name == "n_T"})

    target = tvm_module.target.Target(host_llvm())
    assert agrees(func(script), func(script), target)
    assert not agrees(func(script), func(script.replace("T.float32(0)", "T.float32(1)")), target)
