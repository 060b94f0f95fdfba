"""Inputs that ended in a raw traceback: tokenizer metadata that compiled but did not load,
chat templates that do not compile, manifest fields missing or of the wrong type, paths
leaving the artifact folder, graphs that are YAML but not graphs, a prompt that is not
UTF-8. Each is now one error of a known class, naming the file and the field."""
import os
import subprocess
import sys

import pytest
from tamper import manifest_of, names, rewrite, set_key, target_file

from dflash_ir.artifact import compile_pair, load_compiled
from dflash_ir.errors import ArtifactError
from dflash_ir.models.generator import tiny_vocab
from dflash_ir.models.chat_template import ChatTemplateError
from dflash_ir.models.tokenizer import TokenizerError


TINY_TOKENS = tiny_vocab(320)["tokenizer.ggml.tokens"]


@pytest.mark.parametrize("key, value, problem", [
    ("tokenizer.ggml.merges", ["Ġ t", "no such"], r"tokenizer.ggml.merges\[1\] = 'no such' names 'no', which is not in "
                                                  "tokenizer.ggml.tokens"),
    ("tokenizer.ggml.merges", ["Ġt"], r"tokenizer.ggml.merges\[0\] = 'Ġt' is not two tokens separated by a space"),
    ("tokenizer.ggml.tokens", list(range(320)), "tokenizer.ggml.tokens is not an array of strings"),
    ("tokenizer.ggml.eos_token_id", "5", "tokenizer.ggml.eos_token_id is a str, not a int"),
    ("tokenizer.ggml.bos_token_id", 10**6, r"tokenizer.ggml.bos_token_id = 1000000 is outside the vocabulary \(0..319\)"),
    ("tokenizer.ggml.token_type", [9] * 320, r"tokenizer.ggml.token_type\[0\] = 9 is not a llama.cpp token type"),
    ("tokenizer.ggml.pre", "deepseek-llm", "unsupported pre-tokenizer 'deepseek-llm'"),
    ("tokenizer.ggml.add_bos_token", 1, "tokenizer.ggml.add_bos_token is a int, not a bool"),
    # found by the fuzz campaign (tests/fuzz/regressions/tokenizer/found-a462fa1a...): decoding raised KeyError
    ("tokenizer.ggml.tokens", ["\ufffd", *TINY_TOKENS[1:]], r"token 0 '\ufffd' is NORMAL but not byte-level text"),
])
def test_tokenizer_metadata_the_loader_would_reject_fails_compilation(tmp_path, key, value, problem):
    path = target_file(tmp_path / "t.gguf", set_key(key, value))
    with pytest.raises(TokenizerError, match=names(path) + f": {problem}"):
        compile_pair(path, out=tmp_path / "out")


@pytest.mark.parametrize("template, problem", [
    ("{% for m in messages %}", r"the chat template does not compile: Unexpected end of template.*\(line 1\)"),
    ("{{ messages[0].content }\n{{ x }}", r"the chat template does not compile: unexpected '}' \(line 1\)"),
])
def test_a_chat_template_that_does_not_compile_fails_compilation(tmp_path, template, problem):
    path = target_file(tmp_path / "t.gguf", set_key("tokenizer.chat_template", template))
    with pytest.raises(ChatTemplateError, match=names(path) + ": tokenizer.chat_template: " + problem):
        compile_pair(path, out=tmp_path / "out")


def _drop(*keys):
    def edit(manifest):
        node = manifest
        for k in keys[:-1]:
            node = node[k]
        del node[keys[-1]]
    return edit


def _put(value, *keys):
    def edit(manifest):
        node = manifest
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return edit


@pytest.mark.parametrize("edit, problem", [
    (_drop("config", "n_ctx"), "missing field config.n_ctx"),
    (_put("64", "config", "n_ctx"), "config.n_ctx must be an integer, got '64'"),
    (_put(0, "config", "n_ctx"), r"config.n_ctx = 0 is outside 1..2147483647"),
    (_drop("programs"), "missing field programs"),
    (_put(7, "backend", "name"), "backend.name must be a string, got 7"),
    (_put("zz", "sources", "target", "sha256"), "sources.target.sha256 must be a sha256 hex digest, got 'zz'"),
    (_put(["graphs"], "files"), "files must be a mapping, got list"),
    (_put(10**6, "config", "draft", "block_size"), r"config.draft.block_size = 1000000 is outside 2..256"),
    (_put(16, "config", "n_max"), "config.n_max = 16 is not below the draft's block size 16"),
    (_put([1], "programs", "target.decode", "backend"), "programs.target.decode.backend must be a mapping, got list"),
    (_put("yes", "config", "target", "layer_is_recurrent"),
     "config.target.layer_is_recurrent must be a list of booleans, got 'yes'"),
    (_put("fp4", "config", "numerics"), "config.numerics must be one of exact, q8, got 'fp4'"),
])
def test_manifest_fields_missing_or_mistyped_are_named(copy, edit, problem):
    rewrite(copy, edit)
    with pytest.raises(ArtifactError, match=names(copy / "manifest.yaml") + f": {problem}"):
        load_compiled(copy)


@pytest.mark.parametrize("escape", ["../../etc/passwd", "/etc/passwd", "graphs/../../outside.yaml"])
def test_a_graph_path_leaving_the_artifact_is_refused_before_reading(copy, escape):
    def edit(manifest):
        manifest["programs"]["target.decode"]["graph"] = escape
        manifest["files"][escape] = "0" * 64
    rewrite(copy, edit)
    with pytest.raises(ArtifactError, match=names(copy) + f": listed file path '{escape}' leaves the artifact folder"):
        load_compiled(copy)


@pytest.mark.parametrize("field, value", [("library", "../../lib/evil.so"), ("sources", "/etc")])
def test_a_backend_path_leaving_the_artifact_is_refused_before_any_backend_reads(copy, field, value):
    rewrite(copy, _put({"plan": {"kernels": {}}, field: value}, "programs", "target.decode", "backend"))
    with pytest.raises(ArtifactError, match=f"programs.target.decode.backend.{field} = '{value}' is a path leaving "
                                            "the artifact folder"):
        load_compiled(copy)


def test_a_backend_entry_missing_a_field_is_named(copy, monkeypatch):
    """The schema leaves backend entries to their backends; a KeyError or TypeError from one
    reading its entry is still an ArtifactError naming the program."""
    from dflash_ir.backends.numpy_backend import NumpyBackend

    monkeypatch.setattr(NumpyBackend, "load", lambda self, graph, entry, folder, weights: entry["plan"]["steps"])
    with pytest.raises(ArtifactError, match=r"manifest.yaml: programs.draft.inject.backend is malformed for backend "
                                            r"'numpy' \(KeyError: 'plan'\)"):
        load_compiled(copy)


def test_a_symlink_out_of_the_artifact_is_refused_before_reading(copy, tmp_path):
    outside = tmp_path / "outside.yaml"
    os.mkfifo(outside)            # reading it would block: the path is refused first
    (copy / "graphs" / "target.decode.yaml").unlink()
    (copy / "graphs" / "target.decode.yaml").symlink_to(outside)
    with pytest.raises(ArtifactError, match=r"listed file path 'graphs/target.decode.yaml' resolves to .*outside.yaml, "
                                            "outside the artifact folder"):
        load_compiled(copy)


def test_a_program_missing_or_added_is_named(copy):
    rewrite(copy, _drop("programs", "draft.inject"))
    with pytest.raises(ArtifactError, match=r"the manifest's programs are \['draft.block', 'target.commit', "
                                            r"'target.decode', 'target.prefill', 'target.verify', 'target.verify_s2', "
                                            r"'target.verify_s4'\], expected \['draft.block', 'draft.inject', "):
        load_compiled(copy)


def test_a_commit_program_the_config_does_not_need_is_refused(copy):
    """Without recurrent layers (as the config now says) a target has no commit program."""
    rewrite(copy, _put([False] * 4, "config", "target", "layer_is_recurrent"))
    with pytest.raises(ArtifactError, match=r"the manifest's programs are \[.*'target.commit'.*\], expected "
                                            r"\['draft.block', 'draft.inject', 'target.decode', 'target.prefill', "):
        load_compiled(copy)


@pytest.mark.parametrize("text, problem", [
    ("format: dflash-ir.graph/1\nname: x\n", r"a graph field is missing: 'weights'"),
    ("- 1\n- 2\n", r"not a serialised graph of format 'dflash-ir.graph/1' \(found 'list'\)"),
    ("format: dflash-ir.graph/1\nname: x\ninputs: 5\nweights: []\nstates: []\nnodes: []\noutputs: []\n",
     r"malformed graph \(ValueError: inputs must be a list, got int\)"),
    # found by the fuzz campaign (tests/fuzz/regressions/artifact/found-80bbf5e1...): the verifier hashed a dict
    ("format: dflash-ir.graph/1\nname: x\ninputs: []\nweights: []\nstates: []\noutputs: []\nnodes:\n"
     "- {op: add, inputs: [{a: 1}], outputs: [], attrs: {}}\n",
     r"malformed graph \(ValueError: nodes\[0\].inputs must be a string, got \{'a': 1\}\)"),
    ("a: [1, 2\n", r"not valid YAML"),
])
def test_a_graph_file_that_is_not_a_graph_is_named(copy, text, problem):
    graph = copy / "graphs" / "draft.inject.yaml"
    graph.write_text(text)
    rewrite(copy, lambda m: None)
    with pytest.raises(ArtifactError, match=names(graph) + f": not a valid graph: .*{problem}"):
        load_compiled(copy)


def test_an_invalid_utf8_prompt_on_the_command_line_is_reported(artifact):
    """The bytes of argv as a shell passes them: not UTF-8 at offset 3."""
    done = subprocess.run([sys.executable, "-m", "dflash_ir.cli.run", "--artifact", str(artifact), "-p", b"def\xff(x)",
                           "-n", "2"], capture_output=True, timeout=300)
    assert done.returncode == 1, done.stderr
    err = done.stderr.decode()
    assert "dflash-run: error: the argument of -p is not valid UTF-8: byte 0xff at offset 3 (invalid start byte)" in err
    assert "Traceback" not in err


def test_an_invalid_utf8_prompt_file_is_reported(artifact, tmp_path, capsys):
    from dflash_ir.cli import run as run_cli

    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"caf\xc3")
    assert run_cli.main(["--artifact", str(artifact), "-f", str(prompt), "-n", "2"]) == 1
    assert f"the file {prompt} (-f) is not valid UTF-8: byte 0xc3 at offset 3" in capsys.readouterr().err
    assert manifest_of(artifact)["config"]["n_ctx"] == 64
