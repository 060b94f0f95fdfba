"""fused_moe and fused_matmul lowered as their parts' kernels: the compositions the native
lowering uses (backends/kernels/fused.py), which only need `ctx.sub`, registered for TVM."""
from __future__ import annotations

from ..kernels.fused import fused_matmul_parts, fused_moe
from .lowering import lowers

lowers("fused_moe")(fused_moe)
lowers("fused_matmul")(fused_matmul_parts)
