"""Runtime-owned state buffers of a graph (KV caches, conv and recurrent states)."""
from __future__ import annotations

import numpy as np

from dflash_ir.ir import CAPACITY, Graph
from dflash_ir.quant import storage_shape


def zero_states(graph: Graph, n_ctx: int) -> dict[str, np.ndarray]:
    """Fresh state for `graph`; the symbol C (context capacity) is bound to n_ctx."""
    return {s.value.name: np.zeros(storage_shape(s.value.type.concrete({CAPACITY: n_ctx}), s.value.type.dtype),
                                   s.value.type.dtype.numpy())
            for s in graph.states}
