"""fused_moe and fused_matmul lowered as their parts' kernels: the compositions the native
lowering falls back to (backends/kernels/fused.py), which only need `ctx.sub`, registered for
TVM (the native fused MoE kernels, kernels/moe.py, are kir trees TVM does not build)."""
from __future__ import annotations

from ..kernels.fused import fused_matmul_parts, fused_moe_parts
from .lowering import lowers

lowers("fused_moe")(fused_moe_parts)
lowers("fused_matmul")(fused_matmul_parts)
