"""The scale suite's real-size pairs are generated once into the cache; a quantised target,
once made, no longer needs its Q8_0 source (37 GB for the 35B-A3B shape) on disk."""
import pytest

import dflash_ir.models.generator as generator
from dflash_ir.benchmark import models


@pytest.fixture
def made(tmp_path, monkeypatch):
    """The files the generator is asked to write (it writes empty ones), with the cache in tmp_path."""
    monkeypatch.setattr(models, "cache_dir", lambda kind: tmp_path / kind)
    written = []

    def write(path, *args, **kwargs):
        written.append(path.with_suffix(".gguf").name)
        path.write_bytes(b"")
    monkeypatch.setattr(generator, "write_target", write)
    monkeypatch.setattr(generator, "write_draft", write)
    return tmp_path / "bench" / "qwen35-9b", written


def test_a_quantised_target_on_disk_needs_no_q8_0_source(made):
    folder, written = made
    folder.mkdir(parents=True)
    (folder / "dflash-q8_0.gguf").write_bytes(b"")
    (folder / "target-q4_k_m.gguf").write_bytes(b"")
    model = models.real_model("qwen35-9b-q4_k_m")
    assert written == [] and model.target == folder / "target-q4_k_m.gguf"
    assert not (folder / "target-q8_0.gguf").exists()


def test_a_q8_0_pair_is_generated_once(made):
    folder, written = made
    model = models.real_model("qwen35-9b")
    assert written == ["dflash-q8_0.gguf", "target-q8_0.gguf"] and model.target == folder / "target-q8_0.gguf"
    models.real_model("qwen35-9b")
    assert len(written) == 2
