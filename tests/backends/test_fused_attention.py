"""The fused attention layer as one kernel: one launch per layer between the projections, and
a row's output bit-identical whether it is decoded alone or verified in a block (kernel level;
test_batch_invariance.py checks the same end to end), with the keys a block computes for its
new rows equal to the keys it writes into the caches for later calls."""
from collections import defaultdict

import numpy as np
import pytest

from dflash_ir.artifact import open_pair
from dflash_ir.backends.base import get_backend
from dflash_ir.backends.lowering import lower
from dflash_ir.backends.plan import compile_expr, symbol_param
from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType

VIEWS = ("reshape", "slice")  # nodes between a projection and the layer that are views, not kernels


def _layer_launches(graph, plan, env) -> list:
    """Launches of every step after the attention layer's q/k/v projections and before its
    output projection (views skipped both ways), conditional ones counted when they run."""
    producer = {o.name: i for i, n in enumerate(graph.nodes) for o in n.outputs}
    readers = defaultdict(list)
    for i, n in enumerate(graph.nodes):
        for x in n.inputs:
            readers[x].append(i)
    (layer,) = [i for i, n in enumerate(graph.nodes) if n.op == "fused_attention"]

    def back(name: str) -> int:
        i = producer[name]
        return back(graph.nodes[i].inputs[0]) if graph.nodes[i].op in VIEWS else i

    def forward(name: str) -> int:
        (i,) = readers[name]
        return forward(graph.nodes[i].outputs[0].name) if graph.nodes[i].op in VIEWS else i

    first = max(back(x) for x in graph.nodes[layer].inputs[:3]) + 1
    last = forward(graph.nodes[layer].outputs[0].name)
    return [launch for step in plan.steps if first <= step.node < last and not step.constant
            for launch in step.launches if not launch.when or compile_expr(launch.when)(env)]


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_attention_layer_is_one_launch_per_decode_token(tiny_pair, profile):
    """The generated 4-layer target's full-attention layer (its 4th): norms, RoPE, the cache
    writes, attention and the output gate of a decode token are one kernel."""
    pair = open_pair(*tiny_pair("qwen35", "q8_0"), opt_level=2)
    for name in ("target.decode", "target.verify"):
        graph = pair.graphs[name]
        env = {symbol_param(s): 16 for s in graph.symbols} | {"n_C": 4096}
        launches = _layer_launches(graph, lower(graph, profile), env)
        assert [launch.kernel.rsplit("_", 1)[0] for launch in launches] == \
            ["fused_attention_rows" if profile == "cpu" else "fused_attention"], name


# -- batch invariance at the kernel -------------------------------------------------------------
HQ, HKV, CAP, FILLED, BLOCK = 4, 2, 128, 45, 16


def _layer_graph(rows, D):
    """A gated, persisting Qwen3.5-style layer (partial interleaved M-RoPE) of `rows` rows
    ("T": a verify, 1: a decode) over caches of CAP rows."""
    b = GraphBuilder(f"layer_{rows}")
    q = b.input("q", DType.F32, (rows, HQ, 2 * D))
    k, v = b.input("k", DType.F32, (rows, HKV, D)), b.input("v", DType.F32, (rows, HKV, D))
    k_cache, v_cache = b.state("k_cache", DType.F32, (CAP, HKV, D)), b.state("v_cache", DType.F32, (CAP, HKV, D))
    o, k_all, v_all = b.fused_attention(
        q, k, v, b.weight("q_norm", DType.F32, (D,)), b.weight("k_norm", DType.F32, (D,)),
        b.input("positions", DType.I32, (rows,)), b.input("pos", DType.I32, ()), b.input("kv_len", DType.I32, ()),
        k_cache, v_cache, eps=1e-6, n_rot=16, theta=1e7, sections=(3, 3, 2, 0), interleaved=True, scale=D ** -0.5,
        causal=True, window=0, gated=True, persist=True, variant="decode" if rows == 1 else "block")
    b.update_state(k_cache, k_all)
    b.update_state(v_cache, v_all)
    b.output("o", o)
    return b.build()


@pytest.fixture(params=[("opencl", "cpu"), ("opencl", "gpu"), ("vulkan", "cpu"), ("vulkan", "gpu")], ids="-".join)
def device(request, monkeypatch):
    name, profile = request.param
    backend = get_backend(name)
    reason = backend.unavailable_reason()
    if reason:
        pytest.skip(f"{name}: {reason}")
    monkeypatch.setenv("DFLASH_IR_PROFILE", profile)
    return backend


# head sizes at, and below, the GPU schedule's work-group width (64): a PoCL optimiser bug once
# ran a (uniform branch, then `for (e = lid; e < D; e += 64)`) loop body in the idle lanes
@pytest.mark.parametrize("D", [64, 32])
def test_a_rows_attention_does_not_depend_on_the_rows_beside_it(device, D, tmp_path):
    """From caches filled to FILLED: a verify of 16 rows, one of 7 (the first 7 of the same
    rows) and a decode of each row i over the caches the 16-row verify wrote (its rows before
    i read back from there, where the verify computed them on the fly) give every row the
    same output, bit for bit; both verifies write the same caches."""
    rng = np.random.default_rng(0)
    weights = {"q_norm": 1 + 0.1 * rng.standard_normal(D, np.float32),
               "k_norm": 1 + 0.1 * rng.standard_normal(D, np.float32)}

    def program(rows):
        graph = _layer_graph(rows, D)
        out = tmp_path / str(rows)
        return device.load(graph, device.compile(graph, out), out, lambda w: weights[w.tensor])

    verify, decode = program("T"), program(1)
    rows = {"q": rng.standard_normal((BLOCK, HQ, 2 * D), np.float32), "k": rng.standard_normal((BLOCK, HKV, D), np.float32),
            "v": rng.standard_normal((BLOCK, HKV, D), np.float32),
            "positions": np.arange(FILLED, FILLED + BLOCK, dtype=np.int32)}
    caches = {name: rng.standard_normal((CAP, HKV, D), np.float32) for name in ("k_cache", "v_cache")}

    def run(prog, first, count, states):
        """Outputs and states as host arrays (a program's device arrays last until it runs again)."""
        inputs = {name: x[first:first + count] for name, x in rows.items()}
        inputs |= {"pos": np.int32(FILLED + first), "kv_len": np.int32(FILLED + first + count)}
        got = prog.run(inputs, {name: c.copy() for name, c in states.items()})
        return np.asarray(got.outputs["o"]), {name: np.asarray(c) for name, c in got.states.items()}

    (block, written), (seven, seven_written) = run(verify, 0, BLOCK, caches), run(verify, 0, 7, caches)
    np.testing.assert_array_equal(seven, block[:7])
    for name in caches:
        np.testing.assert_array_equal(seven_written[name][:FILLED + 7], written[name][:FILLED + 7])
    for i in range(BLOCK):
        np.testing.assert_array_equal(run(decode, i, 1, written)[0][0], block[i], err_msg=f"row {i} decoded vs verified")
