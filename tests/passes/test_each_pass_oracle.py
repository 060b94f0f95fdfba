"""Every pass, one at a time, on every fixture model: logits within the f32 contract of the
graphs as built, same greedy argmax, and the verifier passes."""
import numpy as np
import pytest

from dflash_ir.artifact import open_pair
from dflash_ir.interpreter import Interpreter
from dflash_ir.passes.pipeline import PASSES
from dflash_ir.runtime.state import zero_states
from dflash_ir.verifier import verify

pytestmark = pytest.mark.oracle
MODELS = [(kind, precision) for kind in ("dense", "moe") for precision in ("f16", "q8_0")]


def _inputs(graph, ids):
    n = len(ids)
    if graph.meta_dict["kind"] == "block":
        return {"tokens": np.asarray(ids[:16], np.int32), "positions": np.arange(16, dtype=np.int32),
                "pos": np.int32(0), "kv_len": np.int32(16)}
    return {"tokens": np.asarray(ids, np.int32), "positions": np.arange(n, dtype=np.int32), "pos": np.int32(0),
            "kv_len": np.int32(n), "logit_rows": np.arange(n, dtype=np.int32)}


@pytest.mark.parametrize("kind, precision", MODELS)
@pytest.mark.parametrize("program", ["target.verify", "draft.block"])
def test_each_pass_keeps_the_logits(oracle_gguf, oracle_prompts, kind, precision, program):
    pair = open_pair(oracle_gguf(f"{kind}/gguf/{kind}-target-{precision}.gguf"),
                     oracle_gguf(f"{kind}/gguf/{kind}-dflash-f16.gguf"), opt_level=0)
    graph = pair.graphs[program]
    ids = (oracle_prompts["chat"] * 2)[:16]
    inputs, states = _inputs(graph, ids), zero_states(graph, 32)
    ref = Interpreter(graph, pair.weights).run(inputs, states).outputs["logits"]
    for p in PASSES:
        graph = verify(p(graph))
        got = Interpreter(graph, pair.weights).run(inputs, states).outputs["logits"]
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), f"after {p.__name__}"
        assert (got.argmax(-1) == ref.argmax(-1)).all(), f"after {p.__name__}"
