"""Generated tiny model pairs (graphs as built, -O0) and a harness comparing two graphs' runs."""
import numpy as np
import pytest

from dflash_ir.artifact import open_pair
from dflash_ir.interpreter import Interpreter
from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target
from dflash_ir.runtime.state import zero_states

CTX = 40


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """`get(arch, dtype)` -> ModelPair at -O0 of a generated random-weight target + draft."""
    made = {}

    def get(arch: str = "qwen35", dtype: str = "f32"):
        if (arch, dtype) not in made:
            d = tmp_path_factory.mktemp(f"{arch}-{dtype}")
            tcfg = tiny_target_config(arch)
            write_target(d / "target.gguf", tcfg, dtype=dtype, seed=1)
            write_draft(d / "draft.gguf", tiny_draft_config(tcfg), target_cfg=tcfg, dtype=dtype, seed=2)
            made[arch, dtype] = open_pair(d / "target.gguf", d / "draft.gguf", opt_level=0)
        return made[arch, dtype]

    return get


@pytest.fixture(scope="session")
def model_call():
    """`model_call(graph, rows)` -> (inputs, states): see `sample_call`."""
    return sample_call


def sample_call(graph, rows: int, seed: int = 0):
    """Inputs and (random, non-zero) states for one call of a model graph with `rows` new rows after 3 cached."""
    rng = np.random.default_rng(seed)
    start = 3
    values = dict(tokens=rng.integers(0, 300, rows).astype(np.int32),
                  positions=np.arange(start, start + rows, dtype=np.int32), pos=np.int32(start),
                  kv_len=np.int32(start + rows), logit_rows=np.arange(rows, dtype=np.int32))
    sequences = graph.meta_dict.get("slots", 0)
    for j in range(sequences):  # a batched verify: sequence j's rows after 3 + j cached
        at, per = start + j, rows // sequences
        values.update({f"s{j}.positions": np.arange(at, at + per, dtype=np.int32), f"s{j}.pos": np.int32(at),
                       f"s{j}.kv_len": np.int32(at + per)})
    inputs = {v.name: values[v.name] if v.name in values else
              rng.standard_normal(v.type.concrete({"S": rows, "T": rows})).astype(np.float32) for v in graph.inputs}
    states = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in zero_states(graph, CTX).items()}
    return inputs, states


def rows_for(graph) -> int:
    shape = graph.inputs[0].type.shape
    return shape[0] if isinstance(shape[0], int) else 5


@pytest.fixture(scope="session")
def worst_relative():
    """`worst_relative(before, after, weights)`: see `compare`."""
    return compare


def compare(before, after, weights, seed: int = 0) -> float:
    """Largest |difference| / max|value| over every output and state update of two graphs' runs."""
    inputs, states = sample_call(before, rows_for(before), seed)
    a = Interpreter(before, weights).run(inputs, states)
    b = Interpreter(after, weights).run(inputs, states)
    assert a.outputs.keys() == b.outputs.keys() and a.states.keys() == b.states.keys()
    pairs = [(a.outputs[k], b.outputs[k]) for k in a.outputs] + [(a.states[k], b.states[k]) for k in a.states]
    return max(float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30)) for x, y in pairs)
