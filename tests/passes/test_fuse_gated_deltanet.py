import numpy as np
import pytest

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.interpreter import Interpreter
from dflash_ir.passes.fuse_gated_deltanet import fuse_gated_deltanet

GDN_PIECES = {"gated_delta_rule", "l2norm", "silu", "softplus", "sigmoid", "slice"}


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_one_fused_rule_per_recurrent_layer_with_identical_outputs(tiny_models, worst_relative, arch):
    pair = tiny_models(arch)
    recurrent = sum(pair.configs["target"].layer_is_recurrent)
    for name in ("target.prefill", "target.verify", "target.decode"):
        g = pair.graphs[name]
        out = fuse_gated_deltanet(g)
        counts = out.op_counts()
        assert counts["fused_gated_delta_rule"] == recurrent, name
        convs = [n for n in out.nodes if n.op == "causal_conv1d"]
        assert len(convs) == recurrent and all(n.attr["activation"] == "silu" for n in convs), name
        # the attention layers' gate slices and sigmoid stay; nothing of a GDN layer does
        assert counts.get("slice", 0) == g.op_counts()["slice"] - 3 * recurrent, name
        assert counts.get("l2norm", 0) == 0 and "gated_delta_rule" not in counts, name
        assert counts.get("sigmoid", 0) == g.op_counts()["sigmoid"] - recurrent, name
        assert worst_relative(g, out, pair.weights) == 0.0, name  # the references compose exactly


def test_the_draft_has_no_recurrent_layers_to_fuse(tiny_models):
    g = tiny_models().graphs["draft.block"]
    assert fuse_gated_deltanet(g) is g


def _layer(q_start: int = 0, shared_k: bool = False):
    """A GDN layer as the Qwen3.5 builder makes it, on a conv output of 2*8 + 2*4 channels;
    `q_start` shifts the q slice, `shared_k` gives k's norm a second reader."""
    b = GraphBuilder("gdn")
    mixed = b.silu(b.input("mixed", DType.F32, ("T", 24)))
    q = b.l2norm(b.reshape(b.slice(mixed, axis=1, start=q_start, stop=q_start + 8), shape=("T", 2, 4)), eps=1e-6)
    k = b.l2norm(b.reshape(b.slice(mixed, axis=1, start=8, stop=16), shape=("T", 2, 4)), eps=1e-6)
    v = b.reshape(b.slice(mixed, axis=1, start=16, stop=24), shape=("T", 2, 4))
    g = b.mul(b.softplus(b.add(b.input("a", DType.F32, ("T", 2)), b.weight("dt", DType.F32, (2,)))),
              b.weight("ssm_a", DType.F32, (2,)))
    o, new = b.gated_delta_rule(q, k, v, g, b.sigmoid(b.input("b", DType.F32, ("T", 2))),
                                b.input("state", DType.F32, (2, 4, 4)), scale=0.5)
    b.output("o", o)
    b.output("state", new)
    if shared_k:
        b.output("k", k)
    return b.build()


def test_fused_layer_matches_the_unfused_one_bit_for_bit():
    g = _layer()
    out = fuse_gated_deltanet(g)
    assert [n.op for n in out.nodes] == ["silu", "fused_gated_delta_rule"]
    rng = np.random.default_rng(0)
    inputs = {"mixed": rng.standard_normal((3, 24)).astype(np.float32),
              "a": rng.standard_normal((3, 2)).astype(np.float32), "b": rng.standard_normal((3, 2)).astype(np.float32),
              "state": rng.standard_normal((2, 4, 4)).astype(np.float32)}
    weights = {"dt": np.float32([0.5, -1.0]), "ssm_a": np.float32([-0.5, -2.0])}
    want = Interpreter(g, lambda w: weights[w.tensor]).run(inputs, {}).outputs
    got = Interpreter(out, lambda w: weights[w.tensor]).run(inputs, {}).outputs
    assert all(np.array_equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("variant", [dict(q_start=1), dict(shared_k=True)])
def test_other_slices_or_shared_pieces_are_left_alone(variant):
    out = fuse_gated_deltanet(_layer(**variant))
    assert "fused_gated_delta_rule" not in out.op_counts()
