from dataclasses import replace

import numpy as np
import pytest

from dflash_ir.interpreter import Interpreter
from dflash_ir.passes.fuse_moe import fuse_moe

MOE_PIECES = {"expert_matmul", "topk", "softmax", "div", "sum"}
BANKS = ("gate", "up", "down")


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_one_fused_moe_per_layer_with_unchanged_outputs(tiny_models, worst_relative, dtype):
    pair = tiny_models("qwen35moe", dtype)
    for name in ("target.prefill", "target.verify", "target.decode"):
        g = pair.graphs[name]
        out = fuse_moe(g)
        assert out.op_counts()["fused_moe"] == pair.configs["target"].n_layer, name
        assert not MOE_PIECES & out.op_counts().keys(), name
        assert worst_relative(g, out, pair.weights) == 0.0, name


def test_dense_graphs_are_left_alone(tiny_models):
    g = tiny_models("qwen35").graphs["target.verify"]
    assert fuse_moe(g) is g


def test_only_the_selected_experts_are_read(tiny_models, model_call):
    """NaN in every expert the router did not pick: the fused graph's results stay finite and equal."""
    pair = tiny_models("qwen35moe")
    g = pair.graphs["target.decode"]
    topk = [n for n in g.nodes if n.op == "topk"]
    probe = replace(g, outputs=g.outputs + tuple((f"ids.{i}", n.outputs[1].name) for i, n in enumerate(topk)))
    inputs, states = model_call(g, 1)
    selected = Interpreter(probe, pair.weights).run(inputs, states).outputs
    layer_of = {n.outputs[1].name: int(n.outputs[1].name.split(".")[1]) for n in topk}
    picked = {layer_of[name]: set(selected[f"ids.{i}"].ravel()) for i, name in enumerate(layer_of)}
    assert all(len(p) < pair.configs["target"].n_expert for p in picked.values())

    def poisoned(w):
        arr = pair.weights(w)
        if w.tensor.endswith("_exps.weight"):
            arr = arr.copy()
            unpicked = [e for e in range(len(arr)) if e not in picked[int(w.tensor.split(".")[1])]]
            arr[unpicked] = np.nan
        return arr

    fused = fuse_moe(g)
    assert not fused.op_counts().get("expert_matmul")
    clean = Interpreter(fused, pair.weights).run(inputs, states).outputs
    dirty = Interpreter(fused, poisoned).run(inputs, states).outputs
    assert all(np.isfinite(dirty[k]).all() and np.array_equal(dirty[k], clean[k]) for k in clean)
