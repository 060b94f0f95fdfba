"""Every op's reference produces exactly the types its rule promises."""
import numpy as np
import pytest

from dflash_ir.blocks import DECODERS
from dflash_ir.dtypes import DType
from dflash_ir.ops.specialised import OPS
from dflash_ir.ops.registry import all_ops, get_op
from dflash_ir.quant import quantize, storage_shape
from dflash_ir.types import parse_type
from quant_blocks import random_blocks

BINDINGS = {"T": 3, "C": 6}
rng = np.random.default_rng(1)

GDN = ("f32[T,2,8]", "f32[T,2,8]", "f32[T,4,5]", "f32[T,4]", "f32[T,4]", "f32[4,8,5]")
CASES = [  # op, inputs (type strings, or arrays where values matter), attrs
    ("add", ("f32[T,1,4]", "f32[3,1]"), {}),
    ("sub", ("i32[T]", "i32[]"), {}),
    ("mul", ("f32[T,4]", "f32[4]"), {}),
    ("div", ("f32[T,4]", "f32[4]"), {}),
    ("neg", ("f32[T,5]",), {}),
    ("exp", ("f32[T,5]",), {}),
    ("sigmoid", ("f32[T,5]",), {}),
    ("silu", ("f32[T,5]",), {}),
    ("softplus", ("f32[T,5]",), {}),
    ("scale", ("f32[T,2]",), {"factor": 0.5}),
    ("cast", ("f32[T,2]",), {"dtype": "i32"}),
    ("cast", ("f32[T,2]",), {"dtype": "f16"}),
    ("rmsnorm", ("f32[T,8]", "bf16[8]"), {"eps": 1e-6}),
    ("l2norm", ("f32[T,2,8]",), {}),
    ("softmax", ("f32[T,8]",), {}),
    ("topk", ("f32[T,8]",), {"k": 3}),
    ("argmax", ("f32[T,8]",), {}),
    ("sum", ("f32[T,3,2]",), {"axis": 1}),
    ("dequantize", ("q8_0[4,64]",), {}),
    ("embedding", ("q8_0[10,32]", "i32[T]"), {}),
    ("matmul", ("f32[T,64]", "f16[5,64]"), {}),
    ("expert_matmul", ("f32[T,32]", "q8_0[4,6,32]", "i32[T,2]"), {}),
    ("rope", ("f32[T,2,16]", "i32[T,4]"), {"n_rot": 8, "theta": 1e4, "sections": (2, 1, 1, 0), "interleaved": True}),
    ("attention", ("f32[T,4,8]", "f32[C,2,8]", "f32[C,2,6]", np.array(5, np.int32)), {"scale": 0.3}),
    ("kv_write", ("f32[C,2,8]", "f32[T,2,8]", np.array(1, np.int32)), {}),
    ("causal_conv1d", ("f32[T,6]", "f32[6,4]", "f32[3,6]"), {}),
    ("causal_conv1d", ("f32[T,6]", "f16[6,4]", "f32[3,6]"), {"activation": "silu"}),
    ("gated_delta_rule", GDN, {"scale": 0.3}),
    ("gated_delta_rule", GDN, {"scale": 0.3, "head_map": "grouped", "chunk_size": 2}),
    ("concat", ("f32[T,2]", "f32[T,3]"), {"axis": 1}),
    ("slice", ("f32[T,8]",), {"axis": 1, "start": 2, "stop": 5}),
    ("reshape", ("f32[T,12]",), {"shape": ("T", 3, 4)}),
    ("transpose", ("f32[T,2,5]",), {"perm": (2, 0, 1)}),
    ("gather", ("f32[T,5]", "i32[4]"), {"axis": 1}),
    ("repeat", ("f32[T,2]",), {"axis": 1, "repeats": 3, "mode": "interleave"}),
    ("fused_attention", ("f32[T,4,16]", "f32[T,2,8]", "f32[T,2,8]", "f32[8]", "f16[8]", "i32[T]", np.array(1, np.int32),
                         np.array(4, np.int32), "f32[C,2,8]", "f32[C,2,8]"),
     {"eps": 1e-6, "n_rot": 4, "theta": 1e4, "scale": 0.3, "gated": True, "variant": "block"}),
    ("fused_moe", ("f32[T,32]", "f16[4,32]", "q8_0[4,6,32]", "q8_0[4,6,32]", "f16[4,32,6]", "f16[8,32]", "q8_0[8,32]",
                   "f16[32,8]", "f32[32]"), {"k": 2}),
    ("fused_moe", ("f32[T,32]", "f16[4,32]", "q8_0[4,32,32]", "q8_0[4,32,32]", "q4_1[4,32,32]", "q5_0[32,32]",
                   "q5_0[32,32]", "q8_0[32,32]", "f32[32]", "q8_0[T,32]"), {"k": 2}),
    ("expert_matmul", ("q8_0[T,2,64]", "q4_0[4,5,64]", "i32[T,2]"), {}),
    ("matmul", ("q8_0[T,64]", "q5_1[5,64]"), {}),
    ("fused_gated_delta_rule", ("f32[T,52]", "f32[T,4]", "f32[T,4]", "f32[4]", "f32[4]", "f32[4,8,5]"),
     {"key_heads": 2, "eps": 1e-6, "scale": 0.3}),
    ("fused_gated_delta_rule", ("f32[T,52]", "f32[T,4]", "f32[T,4]", "f32[4]", "f32[4]", "f32[4,8,5]"),
     {"key_heads": 2, "eps": 1e-6, "scale": 0.3, "head_map": "grouped", "chunk_size": 2}),
    ("fused_gated_deltanet", ("f32[T,52]", "f16[52,4]", "f32[3,52]", "f32[T,4]", "f32[T,4]", "f32[4]", "f32[4]",
                              "f32[4,8,5]", "f32[T,4,5]", "f32[5]"),
     {"key_heads": 2, "eps": 1e-6, "norm_eps": 1e-5, "scale": 0.3}),
    ("fused_gated_deltanet", ("f32[T,52]", "f32[52,4]", "f32[3,52]", "f32[T,4]", "f32[T,4]", "f32[4]", "f32[4]",
                              "f32[4,8,5]", "f32[T,4,5]", "bf16[5]"),
     {"key_heads": 2, "eps": 1e-6, "norm_eps": 1e-5, "scale": 0.3, "head_map": "grouped", "chunk_size": 2}),
    ("matmul_q8_0", ("f32[T,64]", "q8_0[5,64]", "f32[T,5]"),
     {"form": "gemv", "K": 64, "N": 5, "layout": "q8_0_rowmajor"}),
    ("matmul_q8_0", ("q8_0[T,64]", "q8_0[5,64]"), {"form": "gemv", "K": 64, "N": 5, "layout": "q8_0_rowmajor"}),
    ("quantize_q8_0", ("f32[T,3,64]",), {}),
    ("fused_matmul", ("f32[T,64]", "f32[64]", "q8_0[5,64]", "q8_0[3,64]"),
     {"op": "matmul_q8_0", "form": "gemv", "K": 64, "Ns": (5, 3), "layout": "q8_0_rowmajor", "norm_eps": 1e-6}),
    ("fused_matmul", ("q8_0[T,64]", "q8_0[6,64]", "q8_0[6,64]"),
     {"op": "matmul_q8_0", "form": "gemv", "K": 64, "Ns": (6, 6), "layout": "q8_0_rowmajor", "epilogue": "swiglu"}),
    ("matmul_f16", ("f32[T,64]", "f16[5,64]"), {"form": "gemm", "K": 64, "N": 5, "layout": "f16_rowmajor"}),
    ("matmul_group", ("f32[T,64]", "q8_0[5,64]", "q8_0[3,64]"),
     {"op": "matmul_q8_0", "form": "gemv", "K": 64, "Ns": (5, 3), "layout": "q8_0_rowmajor"}),
    ("swiglu", ("f32[T,4]", "f32[T,4]"), {}),
    ("sigmoid_gate", ("f32[T,4]", "f32[4]"), {}),
] + [(OPS[d], ("f32[T,256]", f"{d}[5,256]"), {"form": "gemv", "K": 256, "N": 5, "layout": f"{d}_rowmajor"})
     for d in DECODERS]


def sample(t):
    """A random value of TensorType t (storage form; i32 values are small valid indices)."""
    shape = t.concrete(BINDINGS)
    if t.dtype is DType.I32:
        return rng.integers(0, 3, shape).astype(np.int32)
    if t.dtype in DECODERS:
        return random_blocks(rng, shape, t.dtype)
    return quantize(rng.standard_normal(shape).astype(np.float32), t.dtype)


def test_every_op_has_a_case_and_a_doc():
    ops = all_ops()
    assert set(ops) == {name for name, _, _ in CASES}
    assert all(op.doc for op in ops.values())


@pytest.mark.parametrize("name, inputs, attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_reference_outputs_match_the_rule(name, inputs, attrs):
    op = get_op(name)
    input_types = [parse_type(f"i32[{','.join(map(str, x.shape))}]") if isinstance(x, np.ndarray) else parse_type(x)
                   for x in inputs]
    arrays = [x if isinstance(x, np.ndarray) else sample(t) for x, t in zip(inputs, input_types)]
    expected = op.output_types(input_types, attrs)
    outputs = op.run(arrays, attrs)
    assert len(outputs) == len(expected)
    for out, t in zip(outputs, expected):
        assert isinstance(out, np.ndarray)
        assert out.dtype == t.dtype.numpy(), f"{name}: {out.dtype} vs {t}"
        assert out.shape == storage_shape(t.concrete(BINDINGS), t.dtype), f"{name}: {out.shape} vs {t}"
