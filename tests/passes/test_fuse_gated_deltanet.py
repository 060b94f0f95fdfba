import numpy as np
import pytest

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.interpreter import Interpreter
from dflash_ir.passes.fuse_gated_deltanet import fuse_gated_deltanet


def assert_bit_identical(model_call, before, after, weights) -> None:
    """Every output and state update of the two graphs' runs equal bit for bit."""
    rows = before.inputs[0].type.shape[0]
    inputs, states = model_call(before, rows if isinstance(rows, int) else 5)
    a = Interpreter(before, weights).run(inputs, states)
    b = Interpreter(after, weights).run(inputs, states)
    assert a.outputs.keys() == b.outputs.keys() and a.states.keys() == b.states.keys()
    for kind, x, y in (("output", a.outputs, b.outputs), ("state", a.states, b.states)):
        for key in x:
            assert np.array_equal(x[key], y[key]), f"{before.name}: {kind} {key} differs"


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_one_fused_layer_per_recurrent_layer_with_identical_outputs(tiny_models, model_call, arch):
    pair = tiny_models(arch)
    recurrent = sum(pair.configs["target"].layer_is_recurrent)
    for name in ("target.prefill", "target.verify", "target.decode", "target.commit"):
        g = pair.graphs[name]
        before = g.op_counts()
        out = fuse_gated_deltanet(g)
        counts = out.op_counts()
        assert counts["fused_gated_deltanet"] == recurrent, name
        # nothing of a GDN layer between its projections is left; the attention layers' gate
        # slices and sigmoids, and the other norms and SiLUs, stay
        assert not {"causal_conv1d", "fused_gated_delta_rule", "gated_delta_rule", "l2norm"} & counts.keys(), name
        assert counts.get("slice", 0) == before["slice"] - 3 * recurrent, name
        assert counts.get("sigmoid", 0) == before["sigmoid"] - recurrent, name
        assert counts.get("rmsnorm", 0) == before["rmsnorm"] - recurrent, name
        assert counts.get("silu", 0) == before["silu"] - 2 * recurrent, name
        assert out.outputs == g.outputs and [s.update for s in out.states] == [s.update for s in g.states], name
        assert_bit_identical(model_call, g, out, pair.weights)  # the references compose exactly


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


def _run(graph, weights, rows: int = 3):
    rng = np.random.default_rng(0)
    inputs = {v.name: rng.standard_normal(v.type.concrete({"T": rows})).astype(np.float32) for v in graph.inputs}
    states = {s.value.name: rng.standard_normal(s.value.type.concrete({})).astype(np.float32) for s in graph.states}
    return Interpreter(graph, lambda w: weights[w.tensor]).run(inputs, states)


def test_fused_recurrence_matches_the_unfused_one_bit_for_bit():
    g = _layer()
    out = fuse_gated_deltanet(g)
    assert [n.op for n in out.nodes] == ["silu", "fused_gated_delta_rule"]
    weights = {"dt": np.float32([0.5, -1.0]), "ssm_a": np.float32([-0.5, -2.0])}
    want, got = _run(g, weights).outputs, _run(out, weights).outputs
    assert all(np.array_equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("variant", [dict(q_start=1), dict(shared_k=True)])
def test_other_slices_or_shared_pieces_are_left_alone(variant):
    out = fuse_gated_deltanet(_layer(**variant))
    assert "fused_gated_delta_rule" not in out.op_counts()


LAYER_WEIGHTS = {"conv_w": np.linspace(-1, 1, 24 * 4, dtype=np.float32).reshape(24, 4),
                 "dt": np.float32([0.5, -1.0]), "ssm_a": np.float32([-0.5, -2.0]),
                 "norm": np.float32([1.0, 0.5, 2.0, -1.0])}


def _full_layer(swiglu: bool = False, z_heads: int = 2, read_conv: bool = False, read_recurrence: bool = False,
                read_norm: bool = False):
    """A whole GDN layer between its projections, from the conv input x (2*8 + 2*4 channels)
    to the gated output, with its two states updated; the other arguments make variants
    the layer rule must leave alone."""
    b = GraphBuilder("gdn_layer")
    conv_state, state = b.state("conv_state", DType.F32, (3, 24)), b.state("ssm_state", DType.F32, (2, 4, 4))
    conv = b.causal_conv1d(b.input("x", DType.F32, ("T", 24)), b.weight("conv_w", DType.F32, (24, 4)), conv_state)
    b.update_state(conv_state, conv[1])
    mixed = b.silu(conv[0])
    q = b.l2norm(b.reshape(b.slice(mixed, axis=1, start=0, stop=8), shape=("T", 2, 4)), eps=1e-6)
    k = b.l2norm(b.reshape(b.slice(mixed, axis=1, start=8, stop=16), shape=("T", 2, 4)), eps=1e-6)
    v = b.reshape(b.slice(mixed, axis=1, start=16, stop=24), shape=("T", 2, 4))
    g = b.mul(b.softplus(b.add(b.input("a", DType.F32, ("T", 2)), b.weight("dt", DType.F32, (2,)))),
              b.weight("ssm_a", DType.F32, (2,)))
    delta = b.gated_delta_rule(q, k, v, g, b.sigmoid(b.input("b", DType.F32, ("T", 2))), state, scale=0.5)
    b.update_state(state, delta[1])
    normed = b.rmsnorm(delta[0], b.weight("norm", DType.F32, (4,)), eps=1e-5)
    z = b.input("z", DType.F32, ("T", z_heads, 4))
    b.output("y", b.swiglu(z, normed) if swiglu else b.mul(normed, b.silu(z)))
    for name, value, read in (("mixed", mixed, read_conv), ("o", delta[0], read_recurrence), ("normed", normed, read_norm)):
        if read:
            b.output(name, value)
    return b.build()


@pytest.mark.parametrize("variant", [dict(), dict(swiglu=True)])
def test_whole_layer_is_one_node_with_the_conv_states_as_its_outputs(variant):
    g = _full_layer(**variant)
    out = fuse_gated_deltanet(g)
    assert [n.op for n in out.nodes] == ["fused_gated_deltanet"]
    (node,) = out.nodes
    assert node.attr["norm_eps"] == 1e-5 and node.attr["eps"] == 1e-6 and node.attr["key_heads"] == 2
    # the state updates are the fused node's outputs, under their old names
    assert {s.value.name: s.update for s in out.states} == {s.value.name: s.update for s in g.states}
    assert set(out.outputs) == set(g.outputs)
    assert {s.update for s in out.states} | {v for _, v in out.outputs} <= {v.name for v in node.outputs}
    want, got = _run(g, LAYER_WEIGHTS), _run(out, LAYER_WEIGHTS)
    for kind in ("outputs", "states"):
        a, b = getattr(want, kind), getattr(got, kind)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), kind


@pytest.mark.parametrize("variant", [dict(z_heads=1), dict(read_conv=True), dict(read_recurrence=True),
                                     dict(read_norm=True)])
def test_layer_with_other_readers_or_a_broadcast_gate_keeps_its_conv_and_norm(variant):
    """A gate that broadcasts, and a conv output, recurrence output or norm read elsewhere:
    the recurrence still fuses, the layer rule does not."""
    out = fuse_gated_deltanet(_full_layer(**variant))
    counts = out.op_counts()
    assert "fused_gated_deltanet" not in counts and counts["rmsnorm"] == 1, variant
    assert counts["causal_conv1d"] == 1 and counts["fused_gated_delta_rule"] == 1, variant
