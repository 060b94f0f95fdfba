"""Kernel builders, one module per op family; importing the package registers them all."""
from . import attention, elementwise, fused, linalg, movement, position, recurrent, reduce  # noqa: F401
