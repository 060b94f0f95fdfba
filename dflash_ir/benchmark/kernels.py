"""Hot kernels at the shapes of real layers: single-node graphs with random data, run through
a backend's own compile + load path, each with the bytes it must move and the FLOPs it does,
so its time becomes GB/s and FLOP/s to hold against the machine's limits.

Shapes (../shared/docs/QWEN35.md): Qwen3.5-9B H 4096, FFN 12288, 16 Q / 4 KV heads x 256,
Gated DeltaNet 16 K / 32 V heads x 128; Qwen3.6-35B-A3B H 2048, experts 512 wide, top-8 + a
shared expert. Decode is one row, verify a DFlash block of 16 rows, prefill a chunk of rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph
from dflash_ir.passes.specialise_matmul import GEMV_ROWS
from dflash_ir.quant import dequantize, quantize

from .limits import beyond_cache_bytes
from .programs import single_graph_runner

F32, F16, Q8 = DType.F32, DType.F16, DType.Q8_0
MAX_COPIES = 64  # of a decode GEMV's weight, to read it from memory rather than cache
EXPERTS_ALLOCATED = 64  # of the 35B-A3B's 256: a token reads only its top-8 either way


@dataclass
class KernelCase:
    """One benchmark case: `graph` with its arrays, and what one call must move and compute."""

    name: str
    family: str                  # gemv, gemm, attention, gdn, moe
    graph: Graph
    weights: dict[str, np.ndarray]
    inputs: dict[str, np.ndarray]
    states: dict[str, np.ndarray] = field(default_factory=dict)
    nbytes: float = 0.0          # minimum bytes one call reads and writes
    flops: float = 0.0

    def runner(self, backend, work_dir, numerics: str = "exact") -> Callable[[], object]:
        return single_graph_runner(backend, self.graph, self.weights, self.inputs, self.states, work_dir, numerics)


def random_q8_0(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Q8_0 storage of random weights, made block by block (normal floats then quantize would
    take seconds per large matrix): scale ~ 1/(127 sqrt(K)), uniform int8 quants."""
    *lead, k = shape
    blocks = np.empty((*lead, k // 32, 34), np.uint8)
    d = np.float16(1.0 / (127.0 * math.sqrt(k)))
    blocks[..., :2] = np.frombuffer(d.tobytes(), np.uint8)
    blocks[..., 2:] = rng.integers(-127, 128, size=(*lead, k // 32, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(*lead, k // 32 * 34)


# where each K-quant a Q4_K_M file holds keeps its f16 scales (ggml-common.h): d, and dmin
K_QUANT_F16_FIELDS = {DType.Q4_K: (0, 2), DType.Q6_K: (208,)}


def random_weight(rng: np.random.Generator, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    """Storage of random `dtype` weights (Q8_0, or a K-quant of K_QUANT_F16_FIELDS) of values
    ~ 1/sqrt(K): Q8_0's as random_q8_0's, a K-quant's random code and sub-scale bytes under
    f16 scales set to match."""
    if dtype is Q8:
        return random_q8_0(rng, shape)
    *lead, k = shape
    blocks = rng.integers(0, 256, size=(*lead, k // dtype.block_size, dtype.block_bytes), dtype=np.uint8)
    d = np.float16(1.0 / (256.0 * math.sqrt(k)))  # a sub-scale times a code is of order 256
    for at in K_QUANT_F16_FIELDS[dtype]:
        blocks[..., at:at + 2] = np.frombuffer(d.tobytes(), np.uint8)
    return blocks.reshape(*lead, -1).view(dtype.numpy())


def _bytes_per_weight(dtype: DType) -> float:
    return dtype.block_bytes / dtype.block_size


def gemv_case(name: str, n: int, k: int, rows: int, seed: int = 0, copies: int | None = None,
              dtype: DType = Q8) -> KernelCase:
    """x[rows, k] @ w[n, k]^T with a `dtype` weight, built as the model builders build a linear
    layer (dequantize, then matmul) of a decode graph (one static row), a verify graph (T
    rows, up to 16) or a prefill graph: the interpreter dequantizes once at load, the passes
    turn it into the kernel those graphs get, a Q8_0 GEMV or a tiled GEMM.
    A decode product (one row) is made over `copies` distinct weights, by default enough
    to span twice the last-level cache, as a model's layers do: one 53 MB matrix read again
    and again would come from a 300 MB L3, not from memory. Each copy has its own x (equal
    values), as each layer has: products of one x would be grouped into one (group_matmuls)."""
    rng = np.random.default_rng(seed)
    weight = n * k * _bytes_per_weight(dtype)
    if copies is None:
        copies = min(MAX_COPIES, max(1, -(-beyond_cache_bytes() // int(weight)))) if rows == 1 else 1
    b = GraphBuilder(name)
    b.meta["kind"] = "decode" if rows == 1 else "verify" if rows <= GEMV_ROWS else "prefill"
    for c in range(copies):
        x = b.input("x" if c == 0 else f"x{c}", F32, (1 if rows == 1 else "T", k))
        b.output(f"y{c}", b.matmul(x, b.dequantize(b.weight(f"w{c}", dtype, (n, k)))))
    family = "gemv" if rows <= GEMV_ROWS else "gemm"
    block = random_weight(rng, (n, k), dtype)
    weights = {f"w{c}": block if c == 0 else _variant(block, c) for c in range(copies)}
    xs = rng.standard_normal((rows, k)).astype(np.float32)
    inputs = {"x" if c == 0 else f"x{c}": xs for c in range(copies)}
    return KernelCase(name, family, b.build(), weights, inputs,
                      nbytes=copies * (weight + 4 * rows * (k + n)), flops=2.0 * copies * rows * n * k)


def _variant(storage: np.ndarray, c: int) -> np.ndarray:
    """Another matrix of the same statistics without drawing new random bytes (the rows
    rotated by c): distinct memory for each copy at the cost of one copy."""
    return np.roll(storage, c, axis=0)


def attention_case(name: str, rows: int, context: int, hq: int = 16, hkv: int = 4, d: int = 256,
                   seed: int = 0) -> KernelCase:
    """`rows` queries over a KV cache filled to `context` (f32, as the runtime keeps it)."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder(name)
    q = b.input("q", F32, ("T", hq, d))
    k, v = b.input("k", F32, ("C", hkv, d)), b.input("v", F32, ("C", hkv, d))
    b.output("o", b.attention(q, k, v, b.input("kv_len", DType.I32, ()), scale=d ** -0.5, causal=True))
    inputs = {"q": rng.standard_normal((rows, hq, d)).astype(np.float32),
              "k": rng.standard_normal((context, hkv, d)).astype(np.float32),
              "v": rng.standard_normal((context, hkv, d)).astype(np.float32), "kv_len": np.int32(context)}
    return KernelCase(name, "attention", b.build(), {}, inputs,
                      nbytes=4.0 * (2 * context * hkv * d + 2 * rows * hq * d), flops=4.0 * rows * hq * context * d)


def gdn_case(name: str, rows: int, hk: int = 16, hv: int = 32, dk: int = 128, dv: int = 128, seed: int = 0) -> KernelCase:
    """Gated delta rule over `rows` tokens from a saved state (a verify's, or a commit's replay)."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder(name)
    q, k = b.input("q", F32, ("T", hk, dk)), b.input("k", F32, ("T", hk, dk))
    g, beta = b.input("g", F32, ("T", hv)), b.input("beta", F32, ("T", hv))
    state = b.state("state", F32, (hv, dk, dv))
    out, final = b.gated_delta_rule(q, k, b.input("v", F32, ("T", hv, dv)), g, beta, state,
                                    scale=dk ** -0.5, head_map="tiled", chunk_size=0)
    b.update_state(state, final)
    b.output("o", out)

    def unit(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    inputs = {"q": unit((rows, hk, dk)), "k": unit((rows, hk, dk)),
              "g": -rng.uniform(0.01, 1.0, (rows, hv)).astype(np.float32),
              "beta": rng.uniform(0.0, 1.0, (rows, hv)).astype(np.float32),
              "v": rng.standard_normal((rows, hv, dv)).astype(np.float32)}
    states = {"state": (rng.standard_normal((hv, dk, dv)) * 0.1).astype(np.float32)}
    state_bytes = 4.0 * hv * dk * dv
    return KernelCase(name, "gdn", b.build(), {}, inputs, states,
                      nbytes=2 * state_bytes + 4.0 * rows * (2 * hk * dk + 2 * hv * dv),
                      flops=6.0 * rows * hv * dk * dv)


def moe_case(name: str, rows: int, width: int = 2048, ff: int = 512, experts: int = EXPERTS_ALLOCATED, k: int = 8,
             seed: int = 0, dtype: DType = Q8, down: DType = Q8) -> KernelCase:
    """The fused MoE block (router, top-k, SwiGLU experts, gated shared expert); gate and up
    of `dtype`, down of `down` (a Q4_K_M file's Q4_K and Q6_K)."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder(name)
    x = b.input("x", F32, ("T", width))
    names = {"router": ((experts, width), F16), "gate_exps": ((experts, ff, width), dtype),
             "up_exps": ((experts, ff, width), dtype), "down_exps": ((experts, width, ff), down),
             "sh_gate": ((ff, width), dtype), "sh_up": ((ff, width), dtype), "sh_down": ((width, ff), down),
             "sh_gate_inp": ((width,), F32)}
    weights = {n: random_weight(rng, s, t) if t.is_block else quantize(rng.standard_normal(s).astype(np.float32) * 0.02, t)
               for n, (s, t) in names.items()}
    b.output("y", b.fused_moe(x, *(b.weight(n, t, s) for n, (s, t) in names.items()), k=k))
    xs = rng.standard_normal((rows, width)).astype(np.float32)
    chosen = np.argsort(-(xs @ dequantize(weights["router"], F16).T), axis=-1)[:, :k]
    read = len(np.unique(chosen)) + 1  # distinct experts hit, plus the shared one
    per_expert = 3 * ff * width
    expert_bytes = ff * width * (2 * _bytes_per_weight(dtype) + _bytes_per_weight(down))  # gate, up, down
    return KernelCase(name, "moe", b.build(), weights, {"x": xs},
                      nbytes=read * expert_bytes + experts * width * 2 + 8.0 * rows * width,
                      flops=2.0 * rows * (k + 1) * per_expert + 2.0 * rows * experts * width)


def default_cases(quick: bool = False) -> list[Callable[[], KernelCase]]:
    """The suite, as factories (cases are built one at a time: the large ones hold ~1 GB).
    `quick` scales every shape down ~16x for smoke tests."""
    if quick:
        return [lambda: gemv_case("q8_0 gemv 512x256", 512, 256, 1, copies=1),
                lambda: gemv_case("q8_0 gemm 32x512x256", 512, 256, 32),
                lambda: attention_case("attention T1 ctx128", 1, 128, hq=4, hkv=2, d=64),
                lambda: gdn_case("gdn T1", 1, hk=2, hv=4, dk=32, dv=32),
                lambda: moe_case("moe T1", 1, width=256, ff=64, experts=8, k=2)]
    return [
        lambda: gemv_case("9B ffn_up gemv 12288x4096", 12288, 4096, 1),
        lambda: gemv_case("9B ffn_down gemv 4096x12288", 4096, 12288, 1),
        lambda: gemv_case("9B attn_q verify 16x8192x4096", 8192, 4096, 16),
        lambda: gemv_case("35B attn_q gemv 8192x2048", 8192, 2048, 1),
        lambda: gemv_case("9B ffn_up gemm 64x12288x4096", 12288, 4096, 64),
        lambda: attention_case("9B attention decode ctx512", 1, 512),
        lambda: attention_case("9B attention decode ctx4096", 1, 4096),
        lambda: attention_case("9B attention verify16 ctx4096", 16, 4096),
        lambda: gdn_case("9B gated delta rule T1", 1),
        lambda: gdn_case("9B gated delta rule verify16", 16),
        lambda: moe_case("35B fused moe T1", 1),
        lambda: moe_case("35B fused moe verify16", 16),
        # what llama.cpp users run: Q4_K_M targets (Q4_K; ffn_down, attn_v and the experts' down in Q6_K)
        lambda: gemv_case("9B ffn_up gemv Q4_K 12288x4096", 12288, 4096, 1, dtype=DType.Q4_K),
        lambda: gemv_case("9B ffn_down gemv Q6_K 4096x12288", 4096, 12288, 1, dtype=DType.Q6_K),
        lambda: gemv_case("9B attn_q verify Q4_K 16x8192x4096", 8192, 4096, 16, dtype=DType.Q4_K),
        lambda: moe_case("35B fused moe Q4_K_M T1", 1, dtype=DType.Q4_K, down=DType.Q6_K),
        lambda: moe_case("35B fused moe Q4_K_M verify16", 16, dtype=DType.Q4_K, down=DType.Q6_K),
    ]
