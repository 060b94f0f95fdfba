"""The fuzz targets (dflash_ir/fuzzing.py) without atheris: every input kept in
regressions/<target>/ (what the campaign found, and the bad-input probe's crash and hang
classes) replays with only documented errors; the seeds pass; a target reports an error
its code does not document as a finding."""
from pathlib import Path

import pytest

from dflash_ir import fuzzing

REGRESSIONS = Path(__file__).parent / "regressions"
CASES = sorted((path.parent.name, path) for path in REGRESSIONS.glob("*/*") if path.is_file())


def test_every_target_keeps_regression_inputs():
    assert {target for target, _ in CASES} == set(fuzzing.TARGETS)


@pytest.mark.parametrize("target, path", CASES, ids=[f"{t}/{p.name}" for t, p in CASES])
def test_regression_input_ends_in_a_documented_error(target, path, deadline):
    fuzzing.TARGETS[target](path.read_bytes())


@pytest.mark.parametrize("target", list(fuzzing.TARGETS))
def test_seeds_are_accepted(target, tmp_path, deadline):
    fuzzing.write_seeds(target, tmp_path)
    for seed in tmp_path.iterdir():
        fuzzing.TARGETS[target](seed.read_bytes())


def test_an_undocumented_error_is_a_finding(tmp_path, monkeypatch):
    from dflash_ir.models import gguf_file

    def broken(path):
        raise IndexError("list index out of range")

    monkeypatch.setattr(gguf_file, "open_gguf", broken)
    with pytest.raises(fuzzing.FuzzFinding, match="IndexError: list index out of range"):
        fuzzing.gguf_target(b"GGUF")
