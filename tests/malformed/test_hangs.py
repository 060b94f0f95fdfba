"""Inputs that hung the process or blew up its memory: per-layer tables built from a bogus
layer count, a chat template that loops 10^10 times, YAML alias bombs, named pipes where
files belong, and block sizes or contexts of hundreds of GiB. Each is now refused, fast."""
import os

import pytest
from tamper import names, rewrite, set_key, target_file

from dflash_ir.artifact import compile_pair, load_compiled, open_engine
from dflash_ir.cli import compile as compile_cli
from dflash_ir.errors import ArtifactError
from dflash_ir.integrity import MANIFEST
from dflash_ir.memory import MemoryLimitError
from dflash_ir.models.chat_template import ChatTemplateError
from dflash_ir.models.gguf_file import GGUFError
from dflash_ir.models.metadata import ModelConfigError


def test_a_small_file_declaring_10_8_layers_is_refused_before_any_per_layer_table(tmp_path, deadline):
    path = target_file(tmp_path / "t.gguf", set_key("qwen35.block_count", 10**8))
    with pytest.raises(ModelConfigError, match=names(path) + ": qwen35.block_count = 100000000 declares more layers "
                                                             r"than the file has tensors for \(4 blocks blk.N\)"):
        compile_pair(path, out=tmp_path / "out")


def test_a_chat_template_that_loops_10_10_times_is_stopped_at_compile_time(tmp_path, deadline):
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    path = target_file(tmp_path / "t.gguf", set_key("tokenizer.chat_template", loop))
    with pytest.raises(ChatTemplateError, match="chat template error: rendering took longer than 2 s"):
        compile_pair(path, out=tmp_path / "out")


@pytest.mark.parametrize("template, problem", [
    ("{{ 'x' * 10**10 }}", "a value longer than 4194304 characters"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "a value longer than 4194304 characters"),
    ("{{ 2 ** 1000000000 }}", r"2 \*\* 1000000000 is too large"),
    ("{{ 'x'.center(10**10) }}", "center asked for more than 4194304 characters"),
    ("{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}", "the rendered prompt passed 4194304 characters"),
])
def test_chat_templates_that_would_allocate_gigabytes_are_stopped(tmp_path, template, problem, deadline):
    path = target_file(tmp_path / "t.gguf", set_key("tokenizer.chat_template", template))
    with pytest.raises(ChatTemplateError, match=problem):
        compile_pair(path, out=tmp_path / "out")


def test_a_yaml_alias_bomb_in_a_graph_is_refused(copy, deadline):
    graph = copy / "graphs" / "target.decode.yaml"
    bomb = "".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 10))
    graph.write_text("l0: &l0 [x]\n" + bomb + graph.read_text())
    rewrite(copy, lambda m: None)
    with pytest.raises(ArtifactError, match=names(graph) + ": not a valid graph: .*line 1: anchors and aliases are "
                                                          "not accepted"):
        load_compiled(copy)


def test_a_named_pipe_as_a_gguf_is_refused_without_waiting(tmp_path, deadline):
    fifo = tmp_path / "t.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GGUFError, match=names(fifo) + ": a named pipe, not a GGUF file"):
        compile_pair(fifo, out=tmp_path / "out")


@pytest.mark.parametrize("rel", ["graphs/target.decode.yaml", MANIFEST])
def test_a_named_pipe_in_an_artifact_is_refused_without_waiting(copy, rel, deadline):
    (copy / rel).unlink()
    os.mkfifo(copy / rel)
    with pytest.raises(ArtifactError, match=names(copy / rel) + " is a named pipe, not a regular file"):
        load_compiled(copy)


def test_a_huge_block_size_from_metadata_is_refused(tmp_path, pair, deadline):
    from tamper import draft_file

    draft = draft_file(tmp_path / "d.gguf", set_key("dflash.block_size", 10**6))
    with pytest.raises(ModelConfigError, match=names(draft) + r": dflash.block_size = 1000000 exceeds 256"):
        compile_pair(pair[0], draft, out=tmp_path / "out")


def test_a_huge_context_from_the_manifest_is_refused_before_allocating(copy, deadline):
    rewrite(copy, lambda m: m["config"].update(n_ctx=10**9))
    with pytest.raises(MemoryLimitError, match=names(copy) + r": needs at least .* GiB \(weights .*, states .* GiB for "
                                                             r"a context of 1000000000 tokens.*more than the .* GiB of "
                                                             r"memory this machine has; compile with a smaller context"):
        load_compiled(copy)


def test_a_huge_context_for_the_interpreter_engine_is_refused_before_allocating(pair, deadline):
    with pytest.raises(MemoryLimitError, match=names(pair[0]) + " with a context of 2000000000: needs at least"):
        open_engine(*pair, n_ctx=2 * 10**9)


def test_a_huge_context_asked_at_compile_time_is_refused_with_the_need(tmp_path, pair, capsys, deadline):
    assert compile_cli.main([str(pair[0]), "-o", str(tmp_path / "out"), "-c", str(2**31 - 1),
                             "--backend", "numpy"]) == 1
    err = capsys.readouterr().err
    assert "memory needed:" in err and "dflash-compile: error:" in err and "more than the" in err, err
    assert not (tmp_path / "out" / MANIFEST).exists()
    with pytest.raises(SystemExit):
        compile_cli.main([str(pair[0]), "-o", str(tmp_path / "out"), "-c", str(2**31)])
    assert "argument -c/--ctx-size: must be in 0..2147483647, got 2147483648" in capsys.readouterr().err
