"""Target graphs built from generated models: structure, taps, and MoE reading only the routed experts."""
import numpy as np
import pytest

from dflash_ir.artifact import open_pair
from dflash_ir.interpreter import Interpreter
from dflash_ir.models.generator import tiny_target_config, write_target
from dflash_ir.runtime.state import zero_states


class RecordingWeight(np.ndarray):
    """A weight that logs which experts (first-axis indices) are read."""

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            self.reads.append(int(key))
        return np.asarray(super().__getitem__(key))


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "t.gguf"
    write_target(path, tiny_target_config("qwen35moe", n_layer=4, n_expert=8, n_expert_used=2), dtype="q8_0")
    return path


def test_moe_reads_only_the_routed_experts(moe_file):
    pair = open_pair(moe_file)
    graph = pair.graphs["target.decode"]
    recorded = {}

    def load(w):
        arr = pair.weights(w)
        if "_exps" in w.tensor:
            arr = arr.view(RecordingWeight)
            arr.reads = recorded.setdefault(w.tensor, [])
        return arr

    interp = Interpreter(graph, load)
    for pos, token in enumerate([3, 17, 42]):
        for reads in recorded.values():
            reads.clear()
        inputs = dict(tokens=np.array([token], np.int32), positions=np.array([pos], np.int32), pos=np.int32(0),
                      kv_len=np.int32(1), logit_rows=np.array([0], np.int32))
        interp.run(inputs, zero_states(graph, 8))
        assert len(recorded) == 3 * 4  # gate, up, down of each of the 4 MoE layers
        for layer in range(4):
            sets = [set(recorded[f"blk.{layer}.ffn_{p}_exps.weight"]) for p in ("gate", "up", "down")]
            assert sets[0] == sets[1] == sets[2] and len(sets[0]) == 2, (layer, sets)
            assert all(len(recorded[f"blk.{layer}.ffn_{p}_exps.weight"]) == 2 for p in ("gate", "up", "down"))


def test_graph_kinds_differ_only_where_they_should(moe_file):
    pair = open_pair(moe_file, taps=(1, 2), opt_level=0)
    prefill, verify, decode = (pair.graphs[f"target.{k}"] for k in ("prefill", "verify", "decode"))
    delta = lambda g: [n.attr for n in g.nodes if n.op == "gated_delta_rule"]  # noqa: E731
    assert len(delta(prefill)) == 3 and all(a["chunk_size"] == 64 for a in delta(prefill))
    assert all(a["chunk_size"] == 0 for a in delta(verify) + delta(decode))
    # a verify outputs the rows its commit replays: every recurrent layer's projections
    commit = pair.graphs["target.commit"]
    assert {v.name for v in commit.inputs} == {f"blk.{i}.{p}" for i in (0, 1, 2)
                                               for p in ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta")}
    assert {v.name: v.type for v in commit.inputs} == {n: verify.output(n).type for n in (v.name for v in commit.inputs)}
    assert {s.value.name for s in commit.states} == {s.value.name for s in verify.states
                                                     if not s.value.name.endswith("_cache")}
    assert delta(commit) == delta(decode)
    # and after the pipeline the commit runs the kernel the verify ran
    fused = {k: [n.attr for n in open_pair(moe_file, taps=(1, 2)).graphs[f"target.{k}"].nodes
                 if n.op == "fused_gated_deltanet"] for k in ("verify", "commit")}
    assert len(fused["commit"]) == 3 and fused["commit"] == fused["verify"]
    assert prefill.output("logits").type.shape == ("R", 320)  # the rows asked for (logit_rows)
    assert verify.output("logits").type.shape == ("T", 320)  # every row, as the verify reads them
    assert decode.output("logits").type.shape == (1, 320) and decode.output("features").type.shape == (1, 2 * 64)
    for g in (verify, decode):
        assert "logit_rows" not in {v.name for v in g.inputs} and "gather" not in g.op_counts()
    assert len(decode.states) == 2 * 3 + 2 * 1  # conv+ssm per GDN layer, k+v per attention layer


def test_tap_outside_the_target_is_refused(moe_file):
    with pytest.raises(ValueError, match="tap layer 4 is outside the target's 4 layers"):
        open_pair(moe_file, taps=(4,))
