"""fused_moe lowered as its parts' kernels: the composition the native lowering uses
(backends/kernels/fused.py), which only needs `ctx.sub`, registered for TVM's kernels."""
from __future__ import annotations

from ..kernels.fused import fused_moe
from .lowering import lowers

lowers("fused_moe")(fused_moe)
