"""The memory a pair needs (dflash_ir/memory.py), part by part, against sizes worked out by
hand from the model configs; and the refusal when the machine has less."""
import math

import pytest

from dflash_ir.artifact import open_pair
from dflash_ir.memory import MemoryLimitError, check_memory, memory_need
from dflash_ir.pair_checks import weight_bytes

F32 = 4
N_CTX = 64


@pytest.fixture(scope="module")
def need(tiny_pair):
    pair = open_pair(*tiny_pair("qwen35", "q8_0"))
    block = pair.configs["draft"].block_size
    return pair, memory_need(pair.graphs, weight_bytes(pair.files, False), N_CTX, block)


def test_states_and_the_rows_a_commit_replays_are_what_the_configs_say(need):
    pair, got = need
    t, d = pair.configs["target"], pair.configs["draft"]
    kv_row = 2 * t.n_head_kv * t.head_dim * F32  # K and V of one position
    attention = [i for i, recurrent in enumerate(t.layer_is_recurrent) if not recurrent]
    gdn_layer = ((t.ssm_conv_kernel - 1) * t.conv_channels + t.ssm_dt_rank * t.ssm_d_state * t.ssm_head_v_dim) * F32
    draft_kv = d.n_layer * 2 * (N_CTX + d.block_size) * d.n_head_kv * d.head_dim * F32
    assert attention and len(attention) < t.n_layer  # a hybrid: both kinds of state are there
    assert got.kv == len(attention) * N_CTX * kv_row + draft_kv
    assert got.recurrent == (t.n_layer - len(attention)) * gdn_layer
    # a verify keeps each recurrent layer's projections of its rows (for the commit), as activations
    projections = (t.conv_channels + t.value_dim + 2 * t.ssm_dt_rank) * F32
    kept = d.block_size * (t.n_layer - len(attention)) * projections
    verify = pair.graphs["target.verify"]
    values = verify.values()
    replayed = sum(math.prod(values[v].type.concrete({"T": d.block_size})) * F32 for name, v in verify.outputs
                   if name in {x.name for x in pair.graphs["target.commit"].inputs})
    assert replayed == kept
    assert got.activations >= kept
    assert got.total == got.weights + got.kv + got.recurrent + got.activations


def test_a_machine_with_less_refuses_naming_every_part(need):
    _, got = need
    check_memory(got, "pair", available=got.total)
    with pytest.raises(MemoryLimitError) as e:
        check_memory(got, "pair", available=got.total - 1)
    for part in ("weights", f"for a context of {N_CTX} tokens: KV caches", "recurrent states", "activations", "compile with a smaller context"):
        assert part in str(e.value), part
