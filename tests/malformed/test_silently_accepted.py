"""Inputs that were accepted although wrong: a source GGUF changed with its mtime put back,
graphs only validated when used, NaN hyperparameters, F32 data labelled F16, out-of-vocabulary
special ids, and CLI values meaning something other than llama.cpp users expect. A valid
file llama.cpp accepts (trailing unit dims) is accepted."""
import hashlib
import json
import os
import re
import struct

import pytest
from tamper import DRAFT_CFG, TARGET_CFG, manifest_of, names, rewrite, set_key, target_file

from dflash_ir import integrity
from dflash_ir.artifact import compile_pair, load_compiled, open_engine
from dflash_ir.cli import run as run_cli
from dflash_ir.errors import ArtifactError
from dflash_ir.models.gguf_file import GGUFError
from dflash_ir.models.metadata import ModelConfigError
from dflash_ir.models.tokenizer import TokenizerError

PROMPT = [5, 77, 123, 9, 250]


def test_a_source_changed_with_its_mtime_put_back_is_refused(pair, tmp_path):
    target = tmp_path / "t.gguf"
    target.write_bytes(pair[0].read_bytes())
    out = compile_pair(target, pair[1], out=tmp_path / "out", n_ctx=64)
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF                                   # one weight byte
    target.write_bytes(data)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert target.stat().st_mtime_ns == st.st_mtime_ns and target.stat().st_size == st.st_size
    with pytest.raises(ArtifactError, match=f"the target GGUF {names(target.resolve())} changed since compilation "
                                            r"\(sha256 mismatch\)"):
        load_compiled(out)


def test_fast_hashes_a_source_only_when_its_fingerprint_changed_and_strict_always(artifact, monkeypatch):
    hashed = []
    monkeypatch.setattr(integrity, "sha256_file", lambda path: hashed.append(path) or _sha256(path))
    load_compiled(artifact, load_tokenizer=False, measure_costs=False)
    assert hashed == []
    load_compiled(artifact, load_tokenizer=False, measure_costs=False, sources="strict")
    assert sorted(p.name for p in hashed) == ["draft.gguf", "target.gguf"]
    with pytest.raises(ValueError, match="source check must be one of fast, strict, not 'quick'"):
        load_compiled(artifact, sources="quick")


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_graphs_the_chosen_mode_does_not_run_are_validated_too(copy):
    """A target-only run never runs draft.inject; a broken one is refused at load anyway."""
    graph = copy / "graphs" / "draft.inject.yaml"
    graph.write_text(graph.read_text().replace("op: ", "op: no_such_op_", 1))
    rewrite(copy, lambda m: None)
    with pytest.raises(ArtifactError, match=names(graph) + r": not a valid graph: graph 'dflash.inject' is malformed:"
                                                          r"\s+- node 0 \(no_such_op_dequantize\): unknown op"):
        load_compiled(copy, n_max=0)


def test_a_graph_reading_a_tensor_the_source_lacks_is_refused(copy):
    graph = copy / "graphs" / "target.decode.yaml"
    graph.write_text(graph.read_text().replace("tensor: output_norm.weight", "tensor: output_norm.bias"))
    rewrite(copy, lambda m: None)
    with pytest.raises(ArtifactError, match=names(copy) + ": graph target.decode reads tensor 'output_norm.bias' of "
                                                          "'target', which the source GGUFs do not have"):
        load_compiled(copy)


@pytest.mark.parametrize("key, value, problem", [
    ("qwen35.rope.freq_base", float("nan"), "qwen35.rope.freq_base = nan is not a finite number"),
    ("qwen35.attention.layer_norm_rms_epsilon", float("inf"),
     "qwen35.attention.layer_norm_rms_epsilon = inf is not a finite number"),
])
def test_nan_and_inf_hyperparameters_are_refused(tmp_path, key, value, problem):
    path = target_file(tmp_path / "t.gguf", set_key(key, value))
    with pytest.raises(ModelConfigError, match=names(path) + f": {problem}"):
        compile_pair(path, out=tmp_path / "out")


def _relabel(path, name: str, type_id: int) -> None:
    """Patch the GGML type of tensor `name` in the file's tensor table."""
    blob = path.read_bytes()
    pos = blob.rindex(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    n_dims = struct.unpack_from("<I", blob, pos)[0]
    at = pos + 4 + 8 * n_dims
    path.write_bytes(blob[:at] + struct.pack("<I", type_id) + blob[at + 4:])


@pytest.mark.parametrize("type_id, label", [(1, "F16"), (30, "BF16")])
def test_f32_data_labelled_f16_or_bf16_is_refused(tmp_path, type_id, label):
    path = target_file(tmp_path / "t.gguf", dtype="f32")
    _relabel(path, "blk.0.attn_qkv.weight", type_id)
    with pytest.raises(GGUFError, match=names(path) + f": tensor .* data starts .* but tensor 'blk.0.attn_qkv.weight' "
                                                      f"before it \\({label} .*F32 data labelled F16"):
        compile_pair(path, out=tmp_path / "out")


@pytest.mark.parametrize("key", ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"])
def test_special_ids_outside_the_vocabulary_are_refused(tmp_path, key):
    path = target_file(tmp_path / "t.gguf", set_key(key, TARGET_CFG.vocab_size))
    with pytest.raises(TokenizerError, match=names(path) + f": {key} = 320 is outside the vocabulary \\(0..319\\)"):
        compile_pair(path, out=tmp_path / "out")


def test_a_valid_file_with_trailing_unit_dims_is_accepted(tmp_path, pair):
    """ne = [64, 128, 1, 1] for a 128 x 64 weight (a valid GGUF llama.cpp loads) runs like ne = [64, 128]."""
    def unit_dims(plan):
        t = plan.tensors["blk.0.attn_qkv.weight"]
        t.values = t.values.reshape(1, 1, *t.values.shape)

    path = target_file(tmp_path / "t.gguf", unit_dims)
    want = open_engine(pair[0]).generate(prompt_ids=PROMPT, max_tokens=6, speculative=False, ignore_eos=True).tokens
    engine = load_compiled(compile_pair(path, out=tmp_path / "out", n_ctx=64), load_tokenizer=False)
    assert engine.generate(prompt_ids=PROMPT, max_tokens=6, speculative=False, ignore_eos=True).tokens == want


# -- the CLI as llama.cpp users expect it --------------------------------------------------------


def _stats(tmp_path, artifact, *flags) -> dict:
    path = tmp_path / "stats.json"
    assert run_cli.main(["--artifact", str(artifact), "-p", "hi", "--ignore-eos", "--stats-json", str(path),
                         *flags]) == 0
    return json.loads(path.read_text())


def test_n_predict_0_reads_the_prompt_and_generates_nothing(artifact, tmp_path, capsys):
    stats = _stats(tmp_path, artifact, "-n", "0")
    assert stats["generated_tokens"] == 0 and stats["prompt_tokens"] > 0
    assert capsys.readouterr().out == "hi\n"


def test_n_predict_minus_1_generates_until_the_context_is_full(artifact, tmp_path):
    """All 64 rows of the context are filled; the last token is sampled from the last row."""
    stats = _stats(tmp_path, artifact, "-n", "-1")
    assert stats["prompt_tokens"] + stats["generated_tokens"] == 64 + 1
    assert stats["stop_reason"] == "context full (64 tokens)"


def test_spec_draft_n_max_0_runs_the_target_alone_and_beyond_the_block_is_refused(artifact, tmp_path, capsys):
    assert _stats(tmp_path, artifact, "-n", "8", "--spec-draft-n-max", "0")["mode"] == "target-only"
    assert _stats(tmp_path, artifact, "-n", "8")["mode"] == "speculative"
    assert run_cli.main(["--artifact", str(artifact), "-p", "hi", "--spec-draft-n-max", "16"]) == 1
    assert "n_max must be in 0..15 for the draft's block size 16 (0: no drafting), got 16" in capsys.readouterr().err


def test_spec_draft_n_max_0_at_compile_time_means_target_only_runs(pair, tmp_path):
    out = compile_pair(*pair, out=tmp_path / "out", n_ctx=64, n_max=0)
    assert manifest_of(out)["config"]["n_max"] == 0
    assert _stats(tmp_path, out, "-n", "4")["mode"] == "target-only"
    with pytest.raises(ValueError, match=r"--spec-draft-n-max must be in 0..15 for the draft's block size 16"):
        compile_pair(*pair, out=tmp_path / "o2", n_ctx=64, n_max=DRAFT_CFG.block_size)


def test_ctx_size_0_takes_the_models_context_and_an_artifact_keeps_its_own(pair, artifact, tmp_path, capsys):
    out = compile_pair(pair[0], out=tmp_path / "out", n_ctx=0)
    assert manifest_of(out)["config"]["n_ctx"] == TARGET_CFG.context_length
    assert run_cli.main(["--artifact", str(artifact), "-p", "hi", "-c", "128"]) == 2
    assert "-c applies when compiling (with -m); an artifact keeps the context it was compiled for" in \
        capsys.readouterr().err


@pytest.mark.parametrize("flag, value, problem", [
    ("-n", "-2", "must be at least -1, got -2"),
    ("--temp", "nan", r"must be a finite number in \[0, inf\), got nan"),
    ("--temp", "-0.5", r"must be a finite number in \[0, inf\), got -0.5"),
    ("--top-p", "0", r"must be a finite number in \(0, 1\], got 0"),
    ("--min-p", "1", r"must be a finite number in \[0, 1\), got 1"),
    ("--top-k", "-1", "must be at least 0, got -1"),
    ("--seed", "-2", r"must be in -1..9223372036854775807, got -2"),
    ("-c", "-1", r"must be in 0..2147483647, got -1"),
    ("--spec-draft-n-max", "-1", r"must be in 0..255, got -1"),
    ("-n", "ten", "must be an integer, got 'ten'"),
    ("--artifact-digest", "abc", "must be a 64-digit lowercase sha256 hex digest, got 'abc'"),
])
def test_every_numeric_flag_is_range_checked(artifact, capsys, flag, value, problem):
    with pytest.raises(SystemExit) as exit_:
        run_cli.main(["--artifact", str(artifact), "-p", "hi", flag, value])
    assert exit_.value.code == 2
    assert re.search(f"argument {flag}[^:]*: {problem}", capsys.readouterr().err)
