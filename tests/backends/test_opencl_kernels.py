"""Every kernel on OpenCL (PoCL here) against the interpreter, on single-node graphs."""
import pytest

from dflash_ir.backends.selftest import CASES, compare


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_interpreter(opencl, name, tmp_path):
    compare(opencl, name, tmp_path)


def test_every_op_has_a_case():
    """A new op (or fused op) without a kernel case here would be untested on every device."""
    from dflash_ir.ops.registry import all_ops

    covered = {n.op for c in CASES.values() for n in c.build().b.build().nodes}
    assert set(all_ops()) - covered == set()
