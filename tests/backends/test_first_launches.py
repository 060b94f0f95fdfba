"""PoCL builds a kernel's work-group function on its first launch at each work-group size
(seconds), and keeps it in a disk cache keyed by the source of the program holding the
kernel. So the load's cost measurement launches every kernel a generation will
(runtime/costs.run_every_size), and compiling validates kernels in programs of its own:
a process that compiled and then loads builds the programs a process that only loads does."""
import pytest

from dflash_ir.artifact import compile_pair, load_compiled
from dflash_ir.backends import opencl as opencl_module
from dflash_ir.runtime import costs
from dflash_ir.runtime.costs import run_every_size

PROMPTS = ([5, 77, 140, 9, 260, 31], list(range(3, 43)))  # 6 and 40 tokens, no MASK


@pytest.fixture
def launched(monkeypatch) -> set:
    """(kernel, work-group size) of every launch on the OpenCL device from now on."""
    seen = set()
    prepare, launch = opencl_module.CLDevice.prepare, opencl_module.CLDevice.launch

    def recorded_prepare(self, launches):
        launches = list(launches)
        seen.update((name, tuple(local)) for name, _, local, _ in launches)
        return prepare(self, launches)

    def recorded_launch(self, kernel, groups, local, args):
        seen.add((kernel, tuple(local)))
        return launch(self, kernel, groups, local, args)
    monkeypatch.setattr(opencl_module.CLDevice, "prepare", recorded_prepare)
    monkeypatch.setattr(opencl_module.CLDevice, "launch", recorded_launch)
    return seen


def test_a_generation_launches_no_kernel_at_a_size_the_load_did_not(opencl, agreeing_pair, launched, tmp_path,
                                                                    monkeypatch):
    """A Q8_0 pair (its products take the CPU tiles: a kernel per row bucket) whose draft is
    right 5 times a round: rounds of 15 and of 3 proposals commit 6 and 4 rows; cost-aware
    rounds, decode steps and the draft's injects after them; prompts of 6 and 40 tokens."""
    monkeypatch.setattr(costs, "run_every_size", run_every_size)  # the suite leaves it out (conftest)
    art = compile_pair(*agreeing_pair("qwen35", 5, "q8_0"), out=tmp_path / "art", backend="opencl", n_ctx=128)
    engine = load_compiled(art, load_tokenizer=False)
    at_load = set(launched)
    runs = [engine.generate(prompt_ids=prompt, max_tokens=24, ignore_eos=True, **kw) for prompt in PROMPTS
            for kw in (dict(adaptive=False), dict(n_max=3, adaptive=False), {}, dict(speculative=False))]
    assert {r["accepted"] for run in runs for r in run.rounds} == {3, 5}
    assert launched - at_load == set()


def test_compiling_leaves_the_programs_a_load_builds_alone(opencl, tiny_pair, tmp_path):
    before = dict(opencl_module._LIBRARY.sources)
    compile_pair(*tiny_pair("qwen35", "q8_0"), out=tmp_path / "art", backend="opencl", n_ctx=64)
    assert opencl_module._LIBRARY.sources == before
