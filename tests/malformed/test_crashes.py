"""Inputs that crashed the process: deeply nested YAML (libyaml's composer overflowed the C
stack), and artifact files edited so that kernels or plans read past their buffers; each
is now refused before anything runs."""
import pytest

from tamper import manifest_of, names, rewrite
from dflash_ir.artifact import compile_pair, load_compiled
from dflash_ir.errors import ArtifactError
from dflash_ir.integrity import MANIFEST, sha256_file
from dflash_ir.serialize import load_yaml
from dflash_ir.strict_yaml import StrictYAMLError

DEEP = "a: " + "[" * 200_000 + "]" * 200_000 + "\n"


def test_a_deeply_nested_manifest_is_refused(copy, deadline):
    body = (copy / MANIFEST).read_text()
    (copy / MANIFEST).write_text(DEEP + body)
    with pytest.raises(ArtifactError, match=names(copy / MANIFEST) + r": not a valid manifest .*line 1: nested deeper "
                                            r"than 64 levels"):
        load_compiled(copy)


def test_a_deeply_nested_graph_is_refused_with_its_hash_updated(copy, deadline):
    graph = copy / "graphs" / "target.decode.yaml"
    graph.write_text(graph.read_text().replace("meta:", "deep: " + "[" * 100_000 + "]" * 100_000 + "\nmeta:", 1))
    rewrite(copy, lambda m: None)
    with pytest.raises(ArtifactError, match=names(graph) + r": not a valid graph: .*nested deeper than 64 levels"):
        load_compiled(copy)


def test_a_deeply_nested_graph_text_is_a_clear_error(deadline):
    with pytest.raises(StrictYAMLError, match="g.yaml: line 1: nested deeper than 64 levels"):
        load_yaml(DEEP, "g.yaml")


def test_an_edited_plan_is_refused_by_the_manifest_digest(copy):
    """A launch grid, buffer or program edited in the manifest (here: a program's graph
    swapped for another's) no longer matches the manifest's digest line."""
    text = (copy / MANIFEST).read_text()
    (copy / MANIFEST).write_text(text.replace("graph: graphs/target.decode.yaml", "graph: graphs/target.prefill.yaml"))
    with pytest.raises(ArtifactError, match=names(copy / MANIFEST) + " was modified after compilation "
                                            r"\(its digest does not match\)"):
        load_compiled(copy)


def test_a_file_edited_with_its_hash_updated_is_refused_by_the_digest(copy):
    graph = copy / "graphs" / "target.decode.yaml"
    graph.write_text(graph.read_text() + "# edited\n")
    old = manifest_of(copy)["files"]["graphs/target.decode.yaml"]
    (copy / MANIFEST).write_text((copy / MANIFEST).read_text().replace(old, sha256_file(graph)))
    with pytest.raises(ArtifactError, match="was modified after compilation \\(its digest does not match\\)"):
        load_compiled(copy)


def test_an_edit_with_every_hash_recomputed_is_refused_by_a_pinned_digest(copy, artifact):
    """Hashes alone cannot stop someone who recomputes all of them; the root digest that
    dflash-compile printed, pinned at load, does."""
    pinned = manifest_of(artifact)["digest"]
    load_compiled(copy, digest=pinned, load_tokenizer=False, measure_costs=False)
    graph = copy / "graphs" / "target.decode.yaml"
    graph.write_text(graph.read_text() + "# edited\n")
    new = rewrite(copy, lambda m: None)
    with pytest.raises(ArtifactError, match=f"the artifact's digest is {new}, not the pinned {pinned}"):
        load_compiled(copy, digest=pinned)


def test_dflash_compile_prints_the_digest_dflash_run_pins(pair, tmp_path, capsys):
    from dflash_ir.cli import compile as compile_cli
    from dflash_ir.cli import run as run_cli

    out = tmp_path / "out"
    assert compile_cli.main([str(pair[0]), str(pair[1]), "-o", str(out), "-c", "64", "--backend", "numpy"]) == 0
    digest = manifest_of(out)["digest"]
    assert f"(digest {digest})" in capsys.readouterr().err
    common = ["--artifact", str(out), "-p", "hi", "-n", "2", "--verify-sources", "strict"]
    assert run_cli.main([*common, "--artifact-digest", digest]) == 0
    assert run_cli.main([*common, "--artifact-digest", "0" * 64]) == 1
    assert f"the artifact's digest is {digest}, not the pinned {'0' * 64}" in capsys.readouterr().err


def test_a_launch_grid_edited_with_every_hash_recomputed_is_refused_by_the_plan_check(pair, tmp_path):
    """The crash once found: a grid edited in the manifest sent a kernel past its buffer
    (host memory under PoCL). With the hashes and digest recomputed and the digest not
    pinned, the launch plan check refuses it at load, naming the program (by its graph's
    name, as the runner's other errors do), node and kernel."""
    from dflash_ir.backends.base import get_backend
    from dflash_ir.backends.launch_check import PlanError

    reason = get_backend("opencl").unavailable_reason()
    if reason:
        pytest.skip(f"opencl: {reason}")
    out = compile_pair(*pair, out=tmp_path / "art", n_ctx=64, backend="opencl")
    steps = manifest_of(out)["programs"]["target.decode"]["backend"]["plan"]["steps"]
    node, launch = steps[0]["node"], steps[0]["launches"][0]

    def widen(m):
        edited = m["programs"]["target.decode"]["backend"]["plan"]["steps"][0]["launches"][0]
        edited["groups"] = [f"({edited['groups'][0]}) * 4096", *edited["groups"][1:]]
    rewrite(out, widen)
    with pytest.raises(PlanError, match=rf"^qwen35\.decode: node {node}: kernel {launch['kernel']}: grid .* \* 4096', "
                                        r".* is not one the kernel was built for"):
        load_compiled(out, load_tokenizer=False, measure_costs=False)
