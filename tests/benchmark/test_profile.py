"""dflash-bench's profile suite: each launch of a decode step, a verify and a draft block priced
in place, on the small synthetic pair (OpenCL on PoCL; skipped without it)."""
import json

import numpy as np
import pytest

from dflash_ir.backends.base import get_backend
from dflash_ir.backends.plan import compile_expr, symbol_param
from dflash_ir.benchmark import cli
from dflash_ir.benchmark.e2e import compiled_engine, prompt_ids
from dflash_ir.benchmark.models import SMALL_SHAPE, synthetic_model
from dflash_ir.benchmark.profile import KERNEL_HASH, profile_engine

PER_LAYER, BESIDE_LAYERS = 5, 4  # tests/backends/test_launch_counts.py: a decode token's launches


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if reason := get_backend("opencl").unavailable_reason():
        pytest.skip(f"opencl: {reason}")
    model = synthetic_model(small=True)
    return model, compiled_engine("opencl", model, tmp_path_factory.mktemp("profile"), n_ctx=128)


def _planned(program, bindings) -> list[str]:
    """The kernels a call with these symbol values launches, read off the plan."""
    env = {symbol_param(s): n for s, n in bindings.items()}
    return [la.kernel for step in program.plan.steps if not step.constant for la in step.launches
            if not la.when or compile_expr(la.when)(env)]


def test_every_launch_of_each_call_is_timed_in_plan_order(engine):
    model, eng = engine
    block = eng.draft.block_size
    calls = profile_engine(eng, prompt_ids(eng, model), "opencl", model.name, repeats=2)
    assert [c.call for c in calls] == ["decode step", f"verify of {block} rows", "draft block"]
    decode, verify, draft = calls
    programs = eng.target.programs
    assert [k for k, *_ in decode.launches] == _planned(programs["decode"], {"C": eng.n_ctx})
    assert [k for k, *_ in verify.launches] == _planned(programs["verify"], {"T": block, "C": eng.n_ctx})
    assert len(decode.launches) == PER_LAYER * SMALL_SHAPE["n_layer"] + BESIDE_LAYERS
    assert draft.launches
    for c in calls:
        assert c.seconds > 0 and c.launch_seconds > 0
        # a launch timed alone costs at least nothing: what differences of whole-prefix timings
        # gave was their jitter, milliseconds of either sign
        assert min(s for *_, s in c.launches) > -5e-5
        families = c.families()
        assert sum(n for _, n, _ in families) == len(c.launches)
        assert sum(s for *_, s in families) == pytest.approx(c.launch_seconds)
        assert [s for *_, s in families] == sorted((s for *_, s in families), reverse=True)
        assert not any(KERNEL_HASH.search(f) for f, *_ in families)
    assert eng.target.n_past == 0 and eng.draft.ctx_len == 0  # left reset


def test_profiled_engine_still_generates_the_target_tokens(engine):
    """Timing a call launch by launch leaves nothing behind that a generation would read."""
    model, eng = engine
    ids = prompt_ids(eng, model)
    want = eng.generate(prompt_ids=ids, max_tokens=12, speculative=False, ignore_eos=True).tokens
    profile_engine(eng, ids, "opencl", model.name, repeats=2)
    assert eng.generate(prompt_ids=ids, max_tokens=12, ignore_eos=True).tokens == want


def test_a_launcher_refuses_a_graph_whose_input_buffer_is_reused(engine):
    """A model graph's memory plan reuses the token ids' slot: a second replay without a new
    upload would read what a later kernel wrote there (PoCL: a segfault in the embedding)."""
    _, eng = engine
    program = eng.target.programs["decode"]
    inputs = {"tokens": np.zeros(1, np.int32), "positions": np.zeros(1, np.int32), "pos": np.int32(0),
              "kv_len": np.int32(1)}
    with pytest.raises(ValueError, match="shares its buffer with .*a launcher cannot replay"):
        program.launcher(inputs, eng.target.states)


def test_profile_suite_writes_its_table_and_skips_the_interpreter(tmp_path, capsys):
    if reason := get_backend("opencl").unavailable_reason():
        pytest.skip(f"opencl: {reason}")
    out = tmp_path / "out"
    assert cli.main(["--quick", "-b", "numpy,opencl", "--suites", "profile", "--models", "synthetic",
                     "-o", str(out)]) == 0
    assert "synthetic-small / numpy: skipped (numpy runs graphs without kernel launches" in capsys.readouterr().out
    r = json.loads((out / "results.json").read_text())
    assert r["failures"] == []
    rows = r["profile"]
    assert {row["backend"] for row in rows} == {"opencl"}
    assert [r["call"] for r in rows] == ["decode step", "verify of 16 rows", "draft block"]
    assert all(sum(f["launches"] for f in r["families"]) == r["launches"] for r in rows)
    assert "## Where the time goes" in (out / "results.md").read_text()
