import numpy as np
import pytest

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.passes.canonicalise import canonicalise
from dflash_ir.passes.fuse_attention import fuse_attention

ATTENTION_PIECES = {"attention", "rope", "kv_write"}
GRAPHS = {"target.prefill": "prefill", "target.verify": "block", "target.decode": "decode", "draft.block": "block"}


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_one_fused_attention_per_layer_with_unchanged_outputs(tiny_models, worst_relative, arch):
    pair = tiny_models(arch)
    n_attention = {"target": sum(not r for r in pair.configs["target"].layer_is_recurrent),
                   "draft": pair.configs["draft"].n_layer}
    for name, variant in GRAPHS.items():
        g = canonicalise(pair.graphs[name])
        out = fuse_attention(g)
        fused = [n for n in out.nodes if n.op == "fused_attention"]
        assert len(fused) == n_attention[name.split(".")[0]], name
        assert not ATTENTION_PIECES & out.op_counts().keys(), name
        target = name.startswith("target")
        assert all(n.attr["variant"] == variant and n.attr["gated"] == target and n.attr["persist"] == target
                   for n in fused), name
        updates = {s.update for s in out.states if s.update and s.value.name.endswith("_cache")}
        assert updates == ({v.name for n in fused for v in n.outputs[1:]} if target else set())
        assert worst_relative(g, out, pair.weights) == 0.0, name


def test_the_inject_graph_is_left_alone(tiny_models):
    g = canonicalise(tiny_models("qwen35").graphs["draft.inject"])
    assert fuse_attention(g) is g


def attention_layer(k_theta: float = 1e4, gate: bool = True):
    b = GraphBuilder("attn")
    b.meta["kind"] = "verify"
    T, H, Hkv, D = "T", 2, 1, 8
    x = b.input("x", DType.F32, (T, H, 2 * D))
    kx = b.input("k", DType.F32, (T, Hkv, D))
    vx = b.input("v", DType.F32, (T, Hkv, D))
    positions, pos, kv_len = (b.input("positions", DType.I32, (T,)), b.input("pos", DType.I32, ()),
                              b.input("kv_len", DType.I32, ()))
    norm = b.weight("norm", DType.F32, (D,))
    q = b.rope(b.rmsnorm(b.slice(x, axis=2, start=0, stop=D), norm, eps=1e-6), positions, n_rot=4, theta=1e4)
    k = b.rope(b.rmsnorm(kx, norm, eps=1e-6), positions, n_rot=4, theta=k_theta)
    caches = [b.state(f"{n}_cache", DType.F32, ("C", Hkv, D)) for n in "kv"]
    k_all, v_all = b.kv_write(caches[0], k, pos), b.kv_write(caches[1], vx, pos)
    b.update_state(caches[0], k_all)
    o = b.reshape(b.attention(q, k_all, v_all, kv_len, scale=0.3, causal=True), shape=(T, H * D))
    if gate:
        o = b.mul(o, b.sigmoid(b.reshape(b.slice(x, axis=2, start=D, stop=2 * D), shape=(T, H * D))))
    b.output("o", o)
    return b.build()


@pytest.mark.parametrize("gate", [True, False])
def test_caches_are_outputs_when_any_is_kept(worst_relative, gate):
    g = attention_layer(gate=gate)
    out = fuse_attention(g)
    assert out.op_counts() == ({"fused_attention": 1} if gate else {"fused_attention": 1, "slice": 1})
    fused = out.nodes[-1]
    assert fused.attr["persist"] and fused.attr["gated"] == gate
    assert fused.attr["variant"] == "block" and out.states[0].update == fused.outputs[1].name
    assert fused.outputs[0].name == g.outputs[0][1]
    assert worst_relative(g, out, lambda w: np.linspace(0.5, 1.5, 8, dtype=np.float32)) == 0.0


def test_q_and_k_with_different_rope_are_not_fused():
    g = attention_layer(k_theta=2e4)
    assert fuse_attention(g) is g
