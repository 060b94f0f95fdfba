"""Shared fixtures: the oracle fixture folder and cached, verified decompressions of its GGUFs."""
from __future__ import annotations

from pathlib import Path

import pytest

from dflash_ir.fixtures import FixtureError, OracleFixtures


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
