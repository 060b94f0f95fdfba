import re

import numpy as np
import pytest

from dflash_ir.ops.recurrent import delta_error, delta_update
from dflash_ir.ops.registry import OpError, get_op
from dflash_ir.types import parse_type
from written_once import written_out

F = np.float32
rng = np.random.default_rng(5)


def types(name, *inputs, **attrs):
    return [str(t) for t in get_op(name).output_types([parse_type(t) for t in inputs], attrs)]


def run(name, *arrays, **attrs):
    return get_op(name).run(arrays, attrs)


# ---- causal_conv1d ---------------------------------------------------------------------

def conv_inputs(T, C, K):
    return (rng.standard_normal((T, C)).astype(F), rng.standard_normal((C, K)).astype(F),
            rng.standard_normal((K - 1, C)).astype(F))


def test_conv_by_hand():
    x = np.array([[1.0], [2.0], [3.0]], F)
    w = np.array([[1.0, 10.0, 100.0]], F)
    state = np.array([[5.0], [7.0]], F)
    y, new_state = run("causal_conv1d", x, w, state)
    # xx = 5 7 1 2 3: y0 = 5 + 70 + 100, y1 = 7 + 10 + 200, y2 = 1 + 20 + 300
    assert y[:, 0].tolist() == [175, 217, 321]
    assert new_state[:, 0].tolist() == [2, 3]


def test_conv_silu_activation_by_hand():
    x, w, state = np.array([[1.0], [2.0]], F), np.array([[1.0, -1.0]], F), np.array([[3.0]], F)
    y, new_state = run("causal_conv1d", x, w, state, activation="silu")
    plain = np.array([3.0 - 1.0, 1.0 - 2.0])  # xx = 3 1 2
    np.testing.assert_allclose(y[:, 0], plain / (1 + np.exp(-plain)), rtol=1e-6)
    assert new_state[:, 0].tolist() == [2.0]  # the state holds inputs, not activations
    with pytest.raises(OpError, match="activation must be one of 'none', 'silu'"):
        types("causal_conv1d", "f32[T,6]", "f32[6,4]", "f32[3,6]", activation="relu")


@pytest.mark.parametrize("T, C, K", [(5, 3, 4), (1, 6, 4), (2, 3, 4), (4, 2, 1)])
def test_conv_matches_zero_padded_loops(T, C, K):
    x, w, state = conv_inputs(T, C, K)
    y, new_state = run("causal_conv1d", x, w, state)
    history = {t - (K - 1): state[t] for t in range(K - 1)}  # rows before 0 come from the state
    history.update({t: x[t] for t in range(T)})
    for t in range(T):
        for c in range(C):
            expected = sum(float(w[c, j]) * float(history[t - (K - 1) + j][c]) for j in range(K))
            assert abs(y[t, c] - expected) < 1e-5
    assert new_state.shape == (K - 1, C)
    for r in range(K - 1):
        np.testing.assert_array_equal(new_state[r], history[T - (K - 1) + r])


@pytest.mark.parametrize("split", [1, 3, 6])
def test_conv_carried_state_equals_one_pass(split):
    x, w, state = conv_inputs(7, 5, 4)
    y, final = run("causal_conv1d", x, w, state)
    y1, mid = run("causal_conv1d", x[:split], w, state)
    y2, end = run("causal_conv1d", x[split:], w, mid)
    np.testing.assert_allclose(np.concatenate([y1, y2]), y, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(end, final)


def test_conv_rule():
    assert types("causal_conv1d", "f32[T,8192]", "f32[8192,4]", "f32[3,8192]") == ["f32[T,8192]", "f32[3,8192]"]
    with pytest.raises(OpError, match=r"causal_conv1d: state rows \(4\) != kernel width - 1 \(3\)"):
        types("causal_conv1d", "f32[T,64]", "f32[64,4]", "f32[4,64]")
    with pytest.raises(OpError, match=r"causal_conv1d: x channels \(64\) != w channels \(32\)"):
        types("causal_conv1d", "f32[T,64]", "f32[32,4]", "f32[3,64]")


# ---- gated_delta_rule -----------------------------------------------------------------

def unit_rows(*shape):
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(F)


def gdn_inputs(T, Hk=2, Hv=4, dk=16, dv=8):
    q, k = unit_rows(T, Hk, dk), unit_rows(T, Hk, dk)
    v = rng.standard_normal((T, Hv, dv)).astype(F)
    g = (-np.logaddexp(0, rng.standard_normal((T, Hv)) + 1)).astype(F)  # log decay < 0
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, Hv))))).astype(F)
    state = (0.3 * rng.standard_normal((Hv, dk, dv))).astype(F)
    return q, k, v, g, beta, state


def gdn_transition_form(q, k, v, g, beta, state, scale, head_of):
    """S_t = e^g (I - β k kᵀ) S_{t-1} + β k vᵀ, o_t = S_tᵀ q·scale, per head in f64."""
    S = state.astype(np.float64)
    out = np.zeros(v.shape)
    dk = k.shape[2]
    for h in range(v.shape[1]):
        kh = head_of(h)
        for t in range(len(q)):
            kt, b = k[t, kh].astype(np.float64), float(beta[t, h])
            S[h] = np.exp(float(g[t, h])) * (np.eye(dk) - b * np.outer(kt, kt)) @ S[h] + b * np.outer(kt, v[t, h])
            out[t, h] = S[h].T @ (q[t, kh] * scale)
    return out, S


@pytest.mark.parametrize("head_map, head_of", [("tiled", lambda h: h % 2), ("grouped", lambda h: h // 2)])
def test_recurrence_matches_transition_form(head_map, head_of):
    inputs = gdn_inputs(6)
    o, s = run("gated_delta_rule", *inputs, scale=0.25, head_map=head_map)
    expected_o, expected_s = gdn_transition_form(*inputs, 0.25, head_of)
    assert o.dtype == F and s.dtype == F
    np.testing.assert_allclose(o, expected_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, expected_s, rtol=1e-5, atol=1e-5)


# the delta rule's step written out (numpy's, the kernel layer's or TensorIR's spelling): β
# times (v - ...), a decay times the state, the state times a decay
DELTA_WRITTEN_OUT = re.compile(r"\b(b|beta)\S* \* \(\S*\bv\b|\bdecay\S* \* \S*(src|state|sk)\b"
                               r"|(S\[e\]|\bs) \* \S*(decay|T\.exp)")


def test_a_delta_rule_step_by_hand():
    # one cell: S = 2, k = 1, v = 3, e^g = 0.5, β = 0.5: kᵀS = 2 over the old state,
    # δ = 0.5 (3 - 0.5 · 2) = 1, S' = 0.5 · 2 + 1 · 1 = 2
    assert delta_error(3.0, 2.0, 0.5, 0.5) == 1.0
    assert delta_update(2.0, 1.0, 1.0, 0.5) == 2.0


def test_the_delta_rule_step_is_written_once():
    """The reference, the kernel layer's three schedules (GPU, CPU vector, CPU per column)
    and TVM's two call delta_error and delta_update, so all compute one order (the decay
    folded into kᵀS over the old state). Each copy they replaced matched the pattern, in
    both orders the tree had (the GPU body and TVM decayed the state first)."""
    hits = written_out(DELTA_WRITTEN_OUT, "dflash_ir/ops/recurrent.py")
    assert not hits, "\n".join(hits)


def test_head_maps_differ_and_ratio_one_agrees():
    inputs = gdn_inputs(3)
    tiled, _ = run("gated_delta_rule", *inputs, scale=1.0, head_map="tiled")
    grouped, _ = run("gated_delta_rule", *inputs, scale=1.0, head_map="grouped")
    assert not np.allclose(tiled, grouped)
    square = gdn_inputs(3, Hk=4, Hv=4)
    np.testing.assert_array_equal(run("gated_delta_rule", *square, scale=1.0, head_map="tiled")[0],
                                  run("gated_delta_rule", *square, scale=1.0, head_map="grouped")[0])


@pytest.mark.parametrize("chunk", [64, 16])
@pytest.mark.parametrize("T", [1, 5, 64, 100, 130])
def test_chunked_equals_recurrence(T, chunk):
    inputs = gdn_inputs(T)
    o, s = run("gated_delta_rule", *inputs, scale=0.25)
    oc, sc = run("gated_delta_rule", *inputs, scale=0.25, chunk_size=chunk)
    assert oc.shape == o.shape and oc.dtype == F and sc.dtype == F
    np.testing.assert_allclose(oc, o, rtol=0, atol=1e-5)
    np.testing.assert_allclose(sc, s, rtol=0, atol=1e-5)


def test_chunked_survives_strong_decay():
    q, k, v, g, beta, state = gdn_inputs(70)
    g = np.full_like(g, -30.0)  # cumulative log decay reaches -2100 within a chunk
    o, s = run("gated_delta_rule", q, k, v, g, beta, state, scale=1.0)
    oc, sc = run("gated_delta_rule", q, k, v, g, beta, state, scale=1.0, chunk_size=64)
    assert np.isfinite(oc).all() and np.isfinite(sc).all()
    np.testing.assert_allclose(oc, o, atol=1e-5)


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("split", [1, 17, 40])
def test_carried_state_equals_one_pass(split, chunk):
    q, k, v, g, beta, state = gdn_inputs(41)
    o, s = run("gated_delta_rule", q, k, v, g, beta, state, scale=0.5, chunk_size=chunk)
    first = (a[:split] for a in (q, k, v, g, beta))
    rest = (a[split:] for a in (q, k, v, g, beta))
    o1, mid = run("gated_delta_rule", *first, state, scale=0.5, chunk_size=chunk)
    o2, end = run("gated_delta_rule", *rest, mid, scale=0.5, chunk_size=chunk)
    np.testing.assert_allclose(np.concatenate([o1, o2]), o, atol=1e-5)
    np.testing.assert_allclose(end, s, atol=1e-5)


@pytest.mark.parametrize("head_map, head_of", [("tiled", lambda h: h % 2), ("grouped", lambda h: h // 2)])
def test_fused_rule_normalises_and_gates_like_the_transition_form(head_map, head_of):
    """The fused op from a raw conv output [q | k | v] and raw gates, against the f64
    transition form fed with hand-normalised q, k and hand-computed decay and β."""
    T, Hk, Hv, dk, dv = 3, 2, 4, 16, 8
    mixed = rng.standard_normal((T, 2 * Hk * dk + Hv * dv)).astype(F)
    a, b = rng.standard_normal((T, Hv)).astype(F), rng.standard_normal((T, Hv)).astype(F)
    dt_bias, ssm_a = rng.standard_normal(Hv).astype(F), -np.exp(rng.standard_normal(Hv)).astype(F)
    state = (0.3 * rng.standard_normal((Hv, dk, dv))).astype(F)
    o, new = run("fused_gated_delta_rule", mixed, a, b, dt_bias, ssm_a, state, key_heads=Hk, eps=1e-6, scale=0.25,
                 head_map=head_map)
    m = mixed.astype(np.float64)
    q, k = (m[:, i * Hk * dk:(i + 1) * Hk * dk].reshape(T, Hk, dk) for i in (0, 1))
    q, k = (x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6) for x in (q, k))
    g = np.log1p(np.exp(a + dt_bias.astype(np.float64))) * ssm_a
    want_o, want_s = gdn_transition_form(q, k, m[:, 2 * Hk * dk:].reshape(T, Hv, dv), g, 1 / (1 + np.exp(-b)),
                                         state, 0.25, head_of)
    np.testing.assert_allclose(o, want_o, atol=2e-5)
    np.testing.assert_allclose(new, want_s, atol=2e-5)


def test_fused_rule_checks_the_channel_split():
    args = ["f32[T,52]", "f32[T,4]", "f32[T,4]", "f32[4]", "f32[4]", "f32[4,8,5]"]
    assert types("fused_gated_delta_rule", *args, key_heads=2, eps=1e-6, scale=0.3) == ["f32[T,4,5]", "f32[4,8,5]"]
    with pytest.raises(OpError, match=r"mixed channels \(52\) != 2 \* key_heads \* key dim .* \(36\)"):
        types("fused_gated_delta_rule", *args, key_heads=1, eps=1e-6, scale=0.3)
    with pytest.raises(OpError, match=r"dt_bias length \(3\) != value heads \(4\)"):
        types("fused_gated_delta_rule", *args[:3], "f32[3]", *args[4:], key_heads=2, eps=1e-6, scale=0.3)


LAYER = ["f32[T,52]", "f32[52,4]", "f32[3,52]", "f32[T,4]", "f32[T,4]", "f32[4]", "f32[4]", "f32[4,8,5]", "f32[T,4,5]",
         "f32[5]"]


def test_layer_op_is_the_conv_the_fused_rule_and_the_gated_norm():
    """fused_gated_deltanet from the conv input: its outputs are those of causal_conv1d (SiLU),
    fused_gated_delta_rule on that, and rmsnorm times silu(z), bit for bit."""
    T, Hk, Hv, dk, dv = 3, 2, 4, 8, 5
    x = rng.standard_normal((T, 2 * Hk * dk + Hv * dv)).astype(F)
    w, conv_state = rng.standard_normal((x.shape[1], 4)).astype(F), rng.standard_normal((3, x.shape[1])).astype(F)
    a, b = rng.standard_normal((T, Hv)).astype(F), rng.standard_normal((T, Hv)).astype(F)
    dt_bias, ssm_a = rng.standard_normal(Hv).astype(F), -np.exp(rng.standard_normal(Hv)).astype(F)
    state, z = (0.3 * rng.standard_normal((Hv, dk, dv))).astype(F), rng.standard_normal((T, Hv, dv)).astype(F)
    norm_w = rng.standard_normal(dv).astype(F)
    rule = dict(key_heads=Hk, eps=1e-6, scale=0.3, head_map="grouped")
    got = run("fused_gated_deltanet", x, w, conv_state, a, b, dt_bias, ssm_a, state, z, norm_w, norm_eps=1e-5, **rule)
    mixed, conv_new = run("causal_conv1d", x, w, conv_state, activation="silu")
    o, new = run("fused_gated_delta_rule", mixed, a, b, dt_bias, ssm_a, state, **rule)
    y = run("mul", run("rmsnorm", o, norm_w, eps=1e-5)[0], run("silu", z)[0])[0]
    assert len(got) == 3
    for have, want in zip(got, (y, conv_new, new)):
        np.testing.assert_array_equal(have, want)


def test_layer_rule_checks_the_gate_and_the_norm():
    assert types("fused_gated_deltanet", *LAYER, key_heads=2, eps=1e-6, norm_eps=1e-6,
                 scale=0.3) == ["f32[T,4,5]", "f32[3,52]", "f32[4,8,5]"]
    attrs = dict(key_heads=2, eps=1e-6, norm_eps=1e-6, scale=0.3)
    with pytest.raises(OpError, match=r"z heads \(1\) != output heads \(4\)"):
        types("fused_gated_deltanet", *LAYER[:8], "f32[T,1,5]", LAYER[9], **attrs)
    with pytest.raises(OpError, match=r"w size \(4\) != x last dim \(5\)"):
        types("fused_gated_deltanet", *LAYER[:9], "f32[4]", **attrs)
    with pytest.raises(OpError, match=r"mixed channels \(52\) != 2 \* key_heads"):
        types("fused_gated_deltanet", *LAYER, **{**attrs, "key_heads": 1})


def test_gdn_rule():
    args = ("f32[T,16,128]", "f32[T,16,128]", "f32[T,32,128]", "f32[T,32]", "f32[T,32]", "f32[32,128,128]")
    assert types("gated_delta_rule", *args, scale=128 ** -0.5) == ["f32[T,32,128]", "f32[32,128,128]"]
    assert len(types("gated_delta_rule", *args, scale=0.1, chunk_size=64)) == 2


@pytest.mark.parametrize("change, attrs, message", [
    ({}, {"head_map": "blocked"}, "head_map must be one of 'tiled', 'grouped'"),
    ({}, {"chunk_size": -1}, "chunk_size must be >= 0"),
    ({2: "f32[T,6,8]", 3: "f32[T,6]", 4: "f32[T,6]", 5: "f32[6,16,8]"}, {},
     r"v heads \(6\) must be a multiple of k heads \(4\)"),
    ({1: "f32[T,4,8]"}, {}, r"k dim \(8\) != q dim \(16\)"),
    ({3: "f32[S,8]"}, {}, r"g rows \(S\) != q rows \(T\)"),
    ({5: "f32[8,16,4]"}, {}, r"state value dim \(4\) != v dim \(8\)"),
    ({4: "f32[T,8,1]"}, {}, "beta must have rank 2"),
])
def test_gdn_rule_rejects(change, attrs, message):
    args = ["f32[T,4,16]", "f32[T,4,16]", "f32[T,8,8]", "f32[T,8]", "f32[T,8]", "f32[8,16,8]"]
    for index, t in change.items():
        args[index] = t
    with pytest.raises(OpError, match=f"gated_delta_rule: {message}"):
        types("gated_delta_rule", *args, **{"scale": 0.25, **attrs})
