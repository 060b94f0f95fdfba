"""Bad inputs, by the class of failure they once caused (crashes, hangs, tracebacks, inputs
silently accepted): fixtures for a tiny pair, its compiled artifact and a copy to tamper
with (tests/conftest.py's `deadline` turns a hang into a failure)."""
from __future__ import annotations

import shutil

import pytest
from tamper import draft_file, target_file

from dflash_ir.artifact import compile_pair


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("malformed-pair")
    return target_file(d / "target.gguf"), draft_file(d / "draft.gguf")


@pytest.fixture(scope="session")
def artifact(pair, tmp_path_factory):
    return compile_pair(*pair, out=tmp_path_factory.mktemp("malformed-art") / "out", n_ctx=64)


@pytest.fixture
def copy(artifact, tmp_path):
    """A fresh copy of the compiled artifact to tamper with."""
    out = tmp_path / "art"
    shutil.copytree(artifact, out)
    return out
