"""Imports every op module, so that the registry is complete."""
from . import attention, elementwise, fused, linalg, position, recurrent, reduce, shape_ops, specialised  # noqa: F401
