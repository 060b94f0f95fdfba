"""What the bench_* files share: the backends to measure ($DFLASH_IR_BENCH_BACKENDS, comma-
separated; default every native backend that can run here, the TVM ones being measured
against them in bench_tvm_vs_native.py) and the bandwidth figures kernel rows are divided by."""
import os

from dflash_ir.backends.base import get_backend, known_backends

BANDWIDTH_GBS: dict[str, float] = {}  # filled by bench_limits.py, read by bench_kernels.py


def bench_backends() -> list[str]:
    names = os.environ.get("DFLASH_IR_BENCH_BACKENDS")
    return names.split(",") if names else [n for n in known_backends() if not n.startswith("tvm-")]


def ready_backend(name: str):
    """The backend, or a pytest skip naming why it cannot run here."""
    import pytest

    backend = get_backend(name)
    reason = backend.unavailable_reason()
    if reason:
        pytest.skip(f"{name}: {reason}")
    return backend
