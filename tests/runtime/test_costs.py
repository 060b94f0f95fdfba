"""Round costs (runtime/costs.py): measured for every verify length, the decode step and the
draft block, after a call of every kind at every row count; cached per artifact and device,
reused on later loads, measured afresh when the artifact or the device changes."""
import json
from collections import defaultdict

import pytest

from dflash_ir.artifact import compile_pair, load_compiled, open_engine
from dflash_ir.backends.numpy_backend import NumpyBackend
from dflash_ir.runtime import costs as costs_module
from dflash_ir.runtime.costs import SpecCosts, cached_costs, measure_round_costs, run_every_size


def test_measurement_times_every_call_of_a_round_and_leaves_the_runners_reset(tiny_pair):
    engine = open_engine(*tiny_pair("qwen35"), n_ctx=64)
    costs = measure_round_costs(engine.target, engine.draft)
    assert len(costs.verify) == engine.draft.block_size
    assert min(costs.verify) > 0 and costs.decode > 0 and costs.draft > 0
    assert list(costs.verify) == sorted(costs.verify)  # a longer verify never costs less
    assert engine.target.n_past == 0 and engine.draft.ctx_len == 0


@pytest.mark.parametrize("arch, n_ctx", [("qwen35", 64), ("qwen35moe", 20), ("llama", 24)])
def test_measurement_first_runs_every_row_count_a_generation_gives_each_program(tiny_pair, monkeypatch, arch, n_ctx):
    """A prompt, a verify and its commit (qwen35's replays recurrent rows, llama's has nothing
    to do), an inject: each at 1..B rows (B = 16), before the timing; in the smallest context
    a measurement takes too."""
    monkeypatch.setattr(costs_module, "run_every_size", run_every_size)  # the suite leaves it out (conftest)
    engine = open_engine(*tiny_pair(arch), n_ctx=n_ctx)
    rows = defaultdict(list)
    for runner, kind in ((engine.target, "prefill"), (engine.target, "verify"), (engine.draft, "inject")):
        _record(runner, kind, rows, len)
    _record(engine.target, "commit", rows, int)
    said = []
    measure_round_costs(engine.target, engine.draft, said.append)
    B = engine.draft.block_size
    assert said == [f"first calls of every program: row counts 1-{n} of 16 done" for n in (4, 8, 12, 16)]
    for kind in ("prefill", "verify", "commit", "inject"):
        assert set(rows[kind]) >= set(range(1, B + 1)), kind
    *first, timed_context = rows["prefill"]  # the timed calls come after the prefill of their context
    assert set(first) == set(range(1, B + 1))
    assert timed_context == min(costs_module.MEASURE_CONTEXT, n_ctx - B - costs_module.TIMED - 1)
    assert engine.target.n_past == 0 and engine.draft.ctx_len == 0


def _record(runner, kind: str, rows, size) -> None:
    call = getattr(runner, kind)

    def recorded(arg, *a, **kw):
        rows[kind].append(size(arg))
        return call(arg, *a, **kw)
    setattr(runner, kind, recorded)


def test_measurement_needs_room_for_a_verify_block(tiny_pair):
    engine = open_engine(*tiny_pair("qwen35"), n_ctx=18)
    with pytest.raises(ValueError, match="more than 19 tokens, this engine has 18"):
        measure_round_costs(engine.target, engine.draft)


class _Measure:
    def __init__(self):
        self.calls = 0

    def __call__(self) -> SpecCosts:
        self.calls += 1
        return SpecCosts(tuple(float(self.calls + k) for k in range(16)), 0.5, 0.25)


def test_cache_is_reused_for_the_same_artifact_and_device_only(tmp_path):
    measure = _Measure()
    first = cached_costs("manifest A", "device 1", measure, folder=tmp_path)
    assert cached_costs("manifest A", "device 1", measure, folder=tmp_path) == first and measure.calls == 1
    assert cached_costs("manifest B", "device 1", measure, folder=tmp_path) != first and measure.calls == 2
    assert cached_costs("manifest A", "device 2", measure, folder=tmp_path) != first and measure.calls == 3
    assert cached_costs("manifest A", "device 1", measure, folder=tmp_path) == first and measure.calls == 3


def test_an_entry_recorded_for_another_key_is_not_used(tmp_path):
    measure = _Measure()
    cached_costs("manifest A", "device 1", measure, folder=tmp_path)
    (entry,) = tmp_path.glob("*.json")
    data = json.loads(entry.read_text())
    data["key"]["device"] = "device 2"
    entry.write_text(json.dumps(data))
    cached_costs("manifest A", "device 1", measure, folder=tmp_path)
    assert measure.calls == 2


def test_load_measures_once_per_artifact_and_device(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_IR_COST_CACHE", str(tmp_path / "cache"))
    calls = []

    def counted(target, draft, progress):
        calls.append(1)
        return measure(target, draft, progress)

    measure = costs_module.measure_round_costs
    monkeypatch.setattr(costs_module, "measure_round_costs", counted)
    pair = tiny_pair("qwen35")
    art = compile_pair(*pair, out=tmp_path / "art", n_ctx=64)
    first = load_compiled(art, load_tokenizer=False).costs
    assert len(calls) == 1 and len(first.verify) == 16
    assert load_compiled(art, load_tokenizer=False).costs == first and len(calls) == 1
    assert load_compiled(art, load_tokenizer=False, measure_costs=False).costs is None and len(calls) == 1
    compile_pair(*pair, out=art, n_ctx=64, n_max=7)  # the same folder, another artifact
    load_compiled(art, load_tokenizer=False)
    assert len(calls) == 2
    monkeypatch.setattr(NumpyBackend, "device_description", lambda self: "another host")
    load_compiled(art, load_tokenizer=False)
    assert len(calls) == 3


def test_a_load_recalls_the_acceptance_kept_for_its_artifact_on_any_device(tiny_pair, tmp_path, monkeypatch):
    """The acceptance file is costs.acceptance_file(manifest text): under the cost cache, one per
    artifact whatever the device (tests/conftest.py gives each load its own; the module's own
    function is loaded afresh here). A load recalls what the file holds."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("dflash_ir.runtime._costs_as_shipped", costs_module.__file__)
    shipped = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, shipped)
    spec.loader.exec_module(shipped)
    monkeypatch.setenv("DFLASH_IR_COST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(costs_module, "acceptance_file", shipped.acceptance_file)
    art = compile_pair(*tiny_pair("qwen35"), out=tmp_path / "art", n_ctx=64)
    manifest = (art / "manifest.yaml").read_text()
    engine = load_compiled(art, load_tokenizer=False)
    assert engine.acceptance_file == shipped.acceptance_file(manifest) and engine.acceptance_file.parent == tmp_path / "cache"
    assert shipped.acceptance_file(manifest + " ") != engine.acceptance_file
    learned = {"trials": [4.0] * 15, "hits": [1.0] * 15}
    engine.acceptance_file.write_text(json.dumps(learned))
    monkeypatch.setattr(NumpyBackend, "device_description", lambda self: "another host")
    assert load_compiled(art, load_tokenizer=False).controller.learned() == learned
