"""Kernels launched per decode token and per 16-row verify of the benchmark's synthetic target
shape (16 layers: 12 Gated DeltaNet, 4 attention) at -O2, in both device profiles.

Every layer is five launches: norm + input projections (one fused_matmul), the layer's core
(fused_gated_deltanet or fused_attention), the output projection + residual, norm + gate/up +
SwiGLU, down + residual. Five is the floor without a grid-wide barrier: each of those
launches needs all outputs of the one before (a norm needs the whole row, a projection the
whole core output). Beside the layers a token launches the embedding, the LM head with the
final norm, the argmax and the concatenation of the tapped hidden states the draft reads.
A prefill's attention layer is two launches: its new K/V rows into the caches, then the
attention over them. A commit (the rollback's replay) is one launch per Gated DeltaNet layer."""
import pytest

from dflash_ir.artifact import open_pair
from dflash_ir.backends.lowering import lower
from dflash_ir.backends.plan import compile_expr
from dflash_ir.benchmark.models import SMALL_SHAPE
from dflash_ir.benchmark.peer import PeerCrashed, peer_unavailable, quantize
from dflash_ir.dtypes import DType
from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target

LAYERS = 16
RECURRENT = 12  # Gated DeltaNet layers; the other four are attention layers
PER_LAYER = 5
INPUT_PROJECTIONS = ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "attn_q", "attn_k", "attn_v")


def _pair(d, dtype: str):
    cfg = tiny_target_config("qwen35", **dict(SMALL_SHAPE, n_layer=LAYERS))
    write_target(d / "target.gguf", cfg, dtype=dtype, seed=0)
    write_draft(d / "draft.gguf", tiny_draft_config(cfg, n_layer=1), target_cfg=cfg, dtype=dtype, seed=1)
    assert sum(cfg.layer_is_recurrent) == RECURRENT
    return d / "target.gguf", d / "draft.gguf"


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """The synthetic target's make (SMALL_SHAPE's sizes: launches do not depend on them) with 16 layers."""
    return open_pair(*_pair(tmp_path_factory.mktemp("launch-counts"), "q8_0"), opt_level=2).graphs


def launches(graph, profile: str, rows: int) -> list:
    """The launches of one call at `rows` rows, in order (constant steps excluded), and the env
    their sizes are evaluated in."""
    env = {"n_T": rows, "n_R": rows, "n_C": 64}
    return [la for s in lower(graph, profile).steps if not s.constant
            for la in s.launches if not la.when or compile_expr(la.when)(env)], env


def launched(graph, profile: str, rows: int) -> list[str]:
    """The kernels one call at `rows` rows launches, in order."""
    return [la.kernel for la in launches(graph, profile, rows)[0]]


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
@pytest.mark.parametrize("name, rows", [("target.decode", 1), ("target.verify", 16)])
def test_a_token_is_five_launches_per_layer(graphs, profile, name, rows):
    kernels = launched(graphs[name], profile, rows)
    products = [k for k in kernels if k.startswith("matmul_")]
    cores = [k for k in kernels if k.startswith(("fused_gated_deltanet", "fused_attention"))]
    others = sorted(k.split("_")[0] for k in kernels if k not in products and k not in cores)
    assert len(cores) == LAYERS
    assert len(products) == (PER_LAYER - 1) * LAYERS + 1  # the LM head with its norm
    assert others == ["argmax", "concat", "embedding"]
    assert len(kernels) == PER_LAYER * LAYERS + 4


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
@pytest.mark.parametrize("name, rows", [("target.decode", 1), ("target.verify", 16)])
def test_a_q4_k_m_file_is_five_launches_per_layer(tmp_path, name, rows, profile):
    """What llama.cpp users run: llama-quantize's Q4_K_M mix (Q4_K, Q6_K, ...) fuses as Q8_0 does,
    on the GPU GEMV and in the CPU tiles."""
    reason = peer_unavailable()
    if reason:
        pytest.skip(reason)
    f16_target, _ = _pair(tmp_path, "f16")
    try:
        target = quantize(f16_target, tmp_path / "target-q4_k_m.gguf", "Q4_K_M")
    except PeerCrashed as e:
        pytest.skip(str(e))
    with open_gguf(target) as f:
        types = {name: t.dtype for name, t in f.tensors.items()}
    assert {DType.Q4_K, DType.Q6_K} <= set(types.values())
    # products of different types are not grouped: a layer whose input projections mix types
    # (llama-quantize's Q6_K for some layers' attn_qkv / attn_v) launches one product per type
    split = sum(len({types[f"blk.{i}.{p}.weight"] for p in INPUT_PROJECTIONS if f"blk.{i}.{p}.weight" in types}) - 1
                for i in range(LAYERS))
    assert split > 0
    kernels = launched(open_pair(target, opt_level=2).graphs[name], profile, rows)
    assert not [k for k in kernels if k.startswith(("rmsnorm", "swiglu"))]
    assert len(kernels) == PER_LAYER * LAYERS + 3 + split  # no tap concat: the target alone


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_q8_numerics_quantise_a_norm_in_one_launch(tmp_path, profile):
    """Under q8 each product's x is quantised to Q8_0 before the product. Where the x is a
    norm's output the norm and the quantisation are one launch (quantize_q8_0 with the norm
    prologue): per layer the two norm-fed products' x, and the final norm. The layer's core
    quantises its own output (q8_out), and the CPU tiles the SwiGLU (swiglu_q8): seven
    launches a layer, not eleven. The GPU GEMV's work-groups hold fewer columns than a block,
    so there the SwiGLU is quantised by a launch of its own: eight."""
    graph = open_pair(*_pair(tmp_path, "q8_0"), opt_level=2, numerics="q8").graphs["target.decode"]
    kernels = launched(graph, profile, 1)
    normed = [k for k in kernels if k.startswith("quantize_q8_0_norm")]
    plain = [k for k in kernels if k.startswith("quantize_q8_0") and k not in normed]
    assert not [k for k in kernels if k.startswith("rmsnorm")]
    assert len(normed) == 2 * LAYERS + 1 and len(plain) == (LAYERS if profile == "gpu" else 0)
    assert len([k for k in kernels if k.startswith(("fused_gated_deltanet", "fused_attention"))]) == LAYERS
    assert len(kernels) == (PER_LAYER + 2) * LAYERS + len(plain) + 5


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_a_prefill_attention_layer_writes_its_rows_then_attends(graphs, profile):
    kernels = launched(graphs["target.prefill"], profile, 64)
    writes = [i for i, k in enumerate(kernels) if k.startswith("new_kv")]
    attends = [i for i, k in enumerate(kernels) if k.startswith("fused_attention")]
    assert len(writes) == len(attends) == LAYERS - RECURRENT
    assert all(a == w + 1 for w, a in zip(writes, attends))


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_a_batched_verify_reads_each_weight_once(graphs, profile):
    """dflash-serve's 4-sequence verify (64 rows) launches each product on the work-groups a
    16-row verify's has: each work-group walks all rows of its output columns, so a weight is
    read from memory once per pass, not once per sequence (the row loop is in the kernel)."""
    def product_groups(name: str, rows: int) -> list[tuple[int, ...]]:
        calls, env = launches(graphs[name], profile, rows)
        return [tuple(compile_expr(g)(env) for g in la.groups) for la in calls if la.kernel.startswith("matmul_")]
    single, batched = product_groups("target.verify", 16), product_groups("target.verify_s4", 64)
    assert len(batched) == (PER_LAYER - 1) * LAYERS + 1
    assert batched == single


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_a_commit_is_one_launch_per_recurrent_layer(graphs, profile):
    """The rollback's replay (target.commit) runs the verify's fused layer kernel (a decode runs
    it specialised to one row), once per Gated DeltaNet layer, and nothing else: the projections
    it replays are the verify's outputs."""
    commit, verify = (launched(graphs[name], profile, 6) for name in ("target.commit", "target.verify"))
    assert len(commit) == RECURRENT
    assert set(commit) == {k for k in verify if k.startswith("fused_gated_deltanet")}
