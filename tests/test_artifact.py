"""Artifacts and CLIs: compile, load, run; every kind of bad input gets its own clear error."""
import shutil

import pytest
import yaml

from dflash_ir import __version__, compile_pair, load_compiled
from dflash_ir.artifact import open_engine, open_pair
from dflash_ir.backends.base import get_backend
from dflash_ir.cli import compile as compile_cli
from dflash_ir.cli import run as run_cli
from dflash_ir.errors import ArtifactError, ContextOverflowError
from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target
from dflash_ir.models.metadata import ModelConfigError

PROMPT = [5, 77, 123, 9, 250]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    tcfg = tiny_target_config("qwen35")
    write_target(d / "target.gguf", tcfg, dtype="q8_0", seed=1)
    write_draft(d / "draft.gguf", tiny_draft_config(tcfg), target_cfg=tcfg, dtype="f16", seed=2)
    return d / "target.gguf", d / "draft.gguf"


@pytest.fixture(scope="module")
def artifact(pair, tmp_path_factory):
    return compile_pair(*pair, out=tmp_path_factory.mktemp("art") / "out", n_ctx=64)


def _copy(artifact, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(artifact, out)
    return out


def test_compile_writes_a_manifest_that_pins_everything(artifact, pair):
    m = yaml.safe_load((artifact / "manifest.yaml").read_text())
    assert m["dflash_ir_version"] == __version__ and m["backend"]["name"] == "numpy"
    assert set(m["programs"]) == {"target.prefill", "target.verify", "target.decode", "target.commit", "target.verify_s2",
                                  "target.verify_s4", "draft.inject", "draft.block"}
    assert m["sources"]["target"]["size"] == pair[0].stat().st_size and len(m["sources"]["draft"]["sha256"]) == 64
    assert set(m["files"]) == {f"graphs/{name}.yaml" for name in m["programs"]}
    assert m["config"]["n_ctx"] == 64  # taps are HF layer ids: llama.cpp's stored ids minus one
    assert m["config"]["taps"] == [t - 1 for t in m["config"]["draft"]["target_layers"]]


def test_loaded_artifact_generates_like_the_direct_engine(artifact, pair):
    engine = load_compiled(artifact)
    direct = open_engine(*pair, n_ctx=64)
    assert engine.generate(prompt_ids=PROMPT, max_tokens=12).tokens == \
        direct.generate(prompt_ids=PROMPT, max_tokens=12, speculative=False).tokens
    assert engine.tokenizer is not None and engine.generate("hi", max_tokens=4, ignore_eos=True).text


def test_edited_artifact_is_refused(artifact, tmp_path):
    out = _copy(artifact, tmp_path)
    g = out / "graphs" / "target.decode.yaml"
    g.write_text(g.read_text().replace("eps: 1.0e-06", "eps: 1.0e-05", 1) + "\n")
    with pytest.raises(ArtifactError, match="graphs/target.decode.yaml was modified after compilation"):
        load_compiled(out)


def test_artifact_from_another_version_is_refused(artifact, tmp_path):
    out = _copy(artifact, tmp_path)
    m = yaml.safe_load((out / "manifest.yaml").read_text())
    m["dflash_ir_version"] = "0.0.1"
    (out / "manifest.yaml").write_text(yaml.safe_dump(m))
    with pytest.raises(ArtifactError, match="made by dflash-ir 0.0.1 .* recompile"):
        load_compiled(out)


def test_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="no manifest.yaml"):
        load_compiled(tmp_path)


def test_changed_source_gguf_is_refused(pair, tmp_path):
    t, d = tmp_path / "t.gguf", tmp_path / "d.gguf"
    shutil.copy(pair[0], t)
    shutil.copy(pair[1], d)
    out = compile_pair(t, d, out=tmp_path / "out", n_ctx=64)
    tcfg = tiny_target_config("qwen35")
    write_target(t, tcfg, dtype="q8_0", seed=99)  # same size, other weights
    with pytest.raises(ArtifactError, match="target GGUF .* changed since compilation \\(sha256 mismatch\\)"):
        load_compiled(out)
    t.unlink()
    with pytest.raises(ArtifactError, match="target GGUF .* is missing"):
        load_compiled(out)


def test_draft_passed_as_target(pair, tmp_path):
    with pytest.raises(ModelConfigError, match="draft"):
        compile_pair(pair[1], pair[1], out=tmp_path / "x")


def test_mismatched_pair(pair, tmp_path):
    other = tiny_target_config("qwen35", hidden=96)
    write_draft(tmp_path / "d96.gguf", tiny_draft_config(other), target_cfg=other, dtype="f16")
    with pytest.raises(ModelConfigError, match="hidden"):
        compile_pair(pair[0], tmp_path / "d96.gguf", out=tmp_path / "x")


def test_prompt_longer_than_context(artifact):
    with pytest.raises(ContextOverflowError, match="prompt has 70 tokens but the context size is 64"):
        load_compiled(artifact, load_tokenizer=False).generate(prompt_ids=list(range(70)))


def test_cli_compile_and_run(pair, tmp_path, capsys):
    out = tmp_path / "cli"
    assert compile_cli.main([str(pair[0]), str(pair[1]), "-o", str(out), "-c", "64", "--backend", "numpy"]) == 0
    assert "compiling target.verify" in capsys.readouterr().err
    stats = tmp_path / "stats.json"
    assert run_cli.main(["--artifact", str(out), "-p", "hello", "-n", "8", "--ignore-eos",
                         "--stats-json", str(stats)]) == 0
    captured = capsys.readouterr()
    # a random draft: the cost-aware length may decode every step (its shadow draft finds no agreement)
    assert captured.out.startswith("hello") and "proposals verified per step (cost-aware)" in captured.err
    assert '"generated_tokens": 8' in stats.read_text()
    assert run_cli.main(["-m", str(pair[0]), "--backend", "numpy", "-p", "hi", "-n", "4", "--jinja", "--no-think"]) == 0
    assert "target-only" in capsys.readouterr().err


def test_cli_prints_progress_unless_quiet(pair, tmp_path, capsys):
    """dflash-compile and dflash-run say what they are doing, a line per stage, the memory
    needed before it is allocated, and the weights' upload by tenths; --quiet: errors only."""
    if get_backend("opencl").unavailable_reason():
        pytest.skip(get_backend("opencl").unavailable_reason())
    out = tmp_path / "art"
    compile_args = [str(pair[0]), "-o", str(out), "-c", "64", "--backend", "opencl"]
    assert compile_cli.main(compile_args) == 0
    err = capsys.readouterr().err
    for stage in ("reading", "memory needed: ", "[3/4] compiling target.decode", "hashing the source GGUFs", "done in"):
        assert f"\ndflash-compile: {stage}" in "\n" + err, stage
    run_args = ["--artifact", str(out), "-p", "hi", "-n", "2", "--ignore-eos"]
    assert run_cli.main(run_args) == 0
    err = capsys.readouterr().err
    for stage in ("checking", "memory needed: ", "[1/4] loading target.prefill on opencl, exact numerics", "weights 100%: "):
        assert f"\ndflash-run: {stage}" in "\n" + err, stage
    weights = [line.split() for line in err.splitlines() if line.startswith("dflash-run: weights ")]
    percents = [int(words[2].rstrip("%:")) for words in weights]
    assert percents == sorted(set(percents)) and percents[-1] == 100
    tensors = len({(w.source, w.tensor) for g in open_pair(pair[0]).graphs.values() for w in g.weights})
    assert f"{tensors} of {tensors} tensors" in err
    assert compile_cli.main([*compile_args, "--quiet"]) == 0 and run_cli.main([*run_args, "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_cli_reports_errors_without_tracebacks(pair, tmp_path, capsys):
    assert compile_cli.main([str(pair[1]), "-o", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "dflash-compile: error:" in err and "pass it as the draft (-md)" in err and "Traceback" not in err
    assert run_cli.main(["--artifact", str(tmp_path / "nothing"), "-p", "x"]) == 1
    assert "no manifest.yaml" in capsys.readouterr().err
