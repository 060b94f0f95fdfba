"""Kernel builders, one module per op family; importing the package registers them all."""
from . import attention, elementwise, fused, linalg, moe, movement, position, recurrent, reduce  # noqa: F401
