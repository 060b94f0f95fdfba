"""Every kernel on OpenCL (PoCL here) against the interpreter, on single-node graphs, in both
device profiles: PoCL gets the CPU schedules by default, and the GPU schedules (what CUDA
and HIP compile) are run here too, so neither goes untested on a machine without a GPU."""
import pytest

from dflash_ir.backends.selftest import CASES, compare


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_interpreter(opencl, name, profile, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_IR_PROFILE", profile)
    compare(opencl, name, tmp_path)


def test_profile_follows_the_device_unless_forced(opencl, monkeypatch):
    import pyopencl as cl

    from dflash_ir.backends.opencl import _context

    monkeypatch.delenv("DFLASH_IR_PROFILE", raising=False)
    assert opencl.profile() == ("cpu" if _context()[2].type & cl.device_type.CPU else "gpu")
    monkeypatch.setenv("DFLASH_IR_PROFILE", "gpu")
    assert opencl.profile() == "gpu"


def test_cpu_profile_schedules_matmul_rowwise(monkeypatch, tmp_path):
    from dflash_ir.backends.lowering import lower

    graph = CASES["matmul_q8_0_16_rows"].build().b.build()
    assert {k.op for k in lower(graph, "cpu").kernels.values()} == {"matmul_rows"}
    assert {k.op for k in lower(graph, "gpu").kernels.values()} == {"matmul_gemv", "matmul_gemm"}
    with pytest.raises(ValueError, match="unknown device profile 'tpu'"):
        lower(graph, "tpu")


def test_every_op_has_a_case():
    """A new op (or fused op) without a kernel case here would be untested on every device."""
    from dflash_ir.ops.registry import all_ops

    covered = {n.op for c in CASES.values() for n in c.build().b.build().nodes}
    assert set(all_ops()) - covered == set()
