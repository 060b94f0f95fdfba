import shutil

import pytest

from dflash_ir.cli.compile import main as compile_main
from dflash_ir.passes.pipeline import PASS_NAMES, run_pipeline, select
from dflash_ir.printer import parse_graph
from dflash_ir.serialize import load_yaml
from dflash_ir.verifier import verify

FUSED = {"fused_attention", "fused_moe", "fused_gated_deltanet", "matmul_q8_0", "matmul_f16", "matmul_group",
         "swiglu", "sigmoid_gate"}
ORDER = ["canonicalise", "fuse_attention", "fuse_moe", "fuse_gated_deltanet", "specialise_matmul", "fuse_elementwise",
         "group_matmuls", "fuse_matmul", "canonicalise"]
DUMPS = ["00-input", *(f"{i:02d}-{p}" for i, p in enumerate(ORDER, 1))]


def names(passes):
    return [p.__name__ for p in passes]


def test_levels_and_selection():
    assert select(0) == [] and names(select(1)) == ["canonicalise"] and names(select()) == ORDER
    assert names(select(2, only=["canonicalise", "group_matmuls"], skip=["group_matmuls"])) == ["canonicalise"] * 2
    assert set(PASS_NAMES) == set(ORDER) | {"quantize_activations"}  # the q8 numerics mode's pass
    with pytest.raises(ValueError, match="unknown pass.*fuse_everything"):
        select(2, skip=["fuse_everything"])
    with pytest.raises(ValueError, match="level"):
        select(3)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_full_pipeline_kernel_counts(tiny_models, worst_relative, arch):
    pair = tiny_models(arch, "q8_0")
    target, draft = pair.configs["target"], pair.configs["draft"]
    for name, g in pair.graphs.items():
        assert run_pipeline(g, level=0) is g
        assert not FUSED & run_pipeline(g, level=1).op_counts().keys()
        out = run_pipeline(g)
        counts = out.op_counts()
        assert "dequantize" not in counts and "matmul" not in counts, name
        if name == "target.commit":  # the recurrent layers alone, one kernel each
            assert counts.keys() <= {"fused_gated_deltanet", "reshape"}, name
            assert counts["fused_gated_deltanet"] == sum(target.layer_is_recurrent), name
        elif name.startswith("target"):  # a batched verify: a mixer per sequence, one FFN over all rows
            seqs = g.meta_dict.get("slots", 1)
            assert counts["fused_attention"] == seqs * sum(not r for r in target.layer_is_recurrent), name
            assert counts.get("fused_moe", 0) == (target.n_layer if target.n_expert else 0), name
            assert counts["fused_gated_deltanet"] == seqs * sum(target.layer_is_recurrent), name
            assert not {"gated_delta_rule", "l2norm", "softplus", "silu"} & counts.keys(), name
        elif name == "draft.block":
            assert counts["fused_attention"] == draft.n_layer
        assert worst_relative(g, out, pair.weights) == 0.0, name  # every pass is bit-identical


def test_dump_writes_text_and_pictures_per_pass(tiny_models, tmp_path):
    g = tiny_models("qwen35", "q8_0").graphs["draft.block"]
    out = run_pipeline(g, dump_dir=tmp_path)
    folder = tmp_path / g.name
    pictures = (".dot", ".png") if shutil.which("dot") else (".dot",)
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{d}{s}" for d in DUMPS for s in (".txt", *pictures))
    for stem in DUMPS:
        verify(parse_graph((folder / f"{stem}.txt").read_text()))
    assert parse_graph((folder / f"{DUMPS[-1]}.txt").read_text()) == out


def test_dflash_compile_takes_opt_level_and_dump_ir(tiny_models, tmp_path, monkeypatch):
    """Pictures as DOT only here (graphviz layout is slow; the test above draws PNGs)."""
    monkeypatch.setattr(shutil, "which", lambda exe: None)
    pair = tiny_models("qwen35moe", "q8_0")
    target, draft = (str(pair.files[r].path) for r in ("target", "draft"))
    assert compile_main([target, draft, "-o", str(tmp_path / "o1"), "--backend", "numpy", "-O", "1",
                         "--dump-ir", str(tmp_path / "ir")]) == 0
    for name, g in pair.graphs.items():
        folder = tmp_path / "ir" / g.name
        for stem in DUMPS[:2]:
            assert (folder / f"{stem}.dot").is_file()
            verify(parse_graph((folder / f"{stem}.txt").read_text()))
        assert not (folder / f"{DUMPS[2]}.txt").exists()
        compiled = load_yaml((tmp_path / "o1" / "graphs" / f"{name}.yaml").read_text())
        assert not FUSED & compiled.op_counts().keys()
    assert compile_main([target, draft, "-o", str(tmp_path / "o0"), "--backend", "numpy"]) == 0
    assert not FUSED & load_yaml((tmp_path / "o0" / "graphs" / "target.verify.yaml").read_text()).op_counts().keys()
    assert compile_main([target, draft, "-o", str(tmp_path / "o2"), "--backend", "numpy", "-O", "2"]) == 0
    assert "fused_moe" in load_yaml((tmp_path / "o2" / "graphs" / "target.verify.yaml").read_text()).op_counts()
