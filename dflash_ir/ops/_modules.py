"""Imports every op module, so that the registry is complete."""
from . import attention, elementwise, linalg, position, recurrent, reduce, shape_ops  # noqa: F401
