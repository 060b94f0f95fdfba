"""Every kernel on Vulkan (lavapipe here) against the interpreter, on single-node graphs, in
both device profiles (lavapipe gets the CPU schedules by default; the GPU schedules are what a
GPU runs); the baseline SPIR-V variant (no optional device feature) on the kernels that read
or write 8/16-bit data; the fallback from a variant the device cannot run."""
import warnings

import pytest

from kernel_cases import CASES, compare
from dflash_ir.backends.vulkan import ENV_VARIANT, VariantFallback

# every kernel family that touches f16, bf16 or block-quant data, where the variants differ
BASELINE_CASES = ["cast_f32_f16", "cast_f16_f32", "rmsnorm_w_f16", "rmsnorm_w_bf16", "dequantize_q8_0", "embedding_f16",
                  "embedding_q8_0", "matmul_f16_5_rows", "matmul_q8_0_1_rows", "matmul_q8_0_16_rows",
                  "matmul_q8_0_q8_x_3_rows", "matmul_f16_residual_3_rows", "expert_matmul_q8_0",
                  "attention_causalTrue_gqa2_T1_kv150", "fused_moe", "matmul_q4_k_16_rows", "matmul_q6_k_1_rows",
                  "matmul_mxfp4_37_rows"]


class LoadSpy:
    """The backend, keeping the programs it loads (and, optionally, editing the entry first)."""

    def __init__(self, backend, edit=None):
        self.backend, self.edit, self.loaded = backend, edit, []

    def compile(self, graph, out_dir):
        entry = self.backend.compile(graph, out_dir)
        return self.edit(entry) if self.edit else entry

    def load(self, graph, entry, artifact_dir, weights):
        program = self.backend.load(graph, entry, artifact_dir, weights)
        self.loaded.append((entry, program))
        return program


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_interpreter(vulkan, name, profile, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_IR_PROFILE", profile)
    compare(vulkan, name, tmp_path)


def test_profile_follows_the_device_unless_forced(vulkan, monkeypatch):
    from dflash_ir.backends.vulkan_device import choose_device, physical_devices

    monkeypatch.delenv("DFLASH_IR_PROFILE", raising=False)
    assert vulkan.profile() == ("cpu" if choose_device(physical_devices()).kind == "CPU" else "gpu")
    monkeypatch.setenv("DFLASH_IR_PROFILE", "gpu")
    assert vulkan.profile() == "gpu"


@pytest.mark.parametrize("name", BASELINE_CASES)
def test_baseline_variant_matches_interpreter(vulkan, name, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VARIANT, "baseline")
    spy = LoadSpy(vulkan)
    compare(spy, name, tmp_path)
    (entry, program), = spy.loaded
    assert entry["variants"]["full"]["features"]  # the variants differ
    assert program.device.features == frozenset(entry["variants"]["baseline"]["features"])


def test_variant_the_device_cannot_run_falls_back_and_says_so(vulkan, tmp_path):
    """An artifact whose full variant needs a feature lavapipe lacks (sparseBinding)."""
    def needs_sparse_binding(entry):
        entry["variants"]["full"]["features"].append("sparseBinding")
        return entry

    spy = LoadSpy(vulkan, needs_sparse_binding)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compare(spy, "matmul_q8_0_5_rows", tmp_path)
    messages = [str(w.message) for w in caught if issubclass(w.category, VariantFallback)]
    assert len(messages) == 1 and "'full'" in messages[0] and "sparseBinding" in messages[0], messages
    (entry, program), = spy.loaded
    assert program.device.features == frozenset(entry["variants"]["baseline"]["features"])
