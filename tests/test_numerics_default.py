"""The default numerics mode is the device's (Backend.device_numerics): q8 on PoCL with AVX-512
VNNI, where it decodes faster (README, "Numerics"), exact elsewhere; $DFLASH_IR_NUMERICS
overrides it, and the artifact records the mode taken."""
import pytest
import yaml

from dflash_ir.backends.base import get_backend, host_cpu_flags
from dflash_ir.cli import compile as compile_cli
from dflash_ir.integrity import MANIFEST


def _compile(tiny_pair, out, *args) -> str:
    target, draft = tiny_pair("qwen35", "q8_0")
    assert compile_cli.main([str(target), str(draft), "-o", str(out), "-c", "64", *args]) == 0
    numerics = yaml.safe_load((out / MANIFEST).read_text())["config"]["numerics"]
    quantized = any("quantize_q8_0" in g.read_text() for g in (out / "graphs").glob("*.yaml"))
    assert quantized == (numerics == "q8")
    return numerics


def test_the_interpreter_defaults_to_exact_and_takes_q8_when_named(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_IR_NUMERICS")
    assert _compile(tiny_pair, tmp_path / "default", "--backend", "numpy") == "exact"
    assert _compile(tiny_pair, tmp_path / "q8", "--backend", "numpy", "--numerics", "q8") == "q8"
    monkeypatch.setenv("DFLASH_IR_NUMERICS", "q8")
    assert _compile(tiny_pair, tmp_path / "env", "--backend", "numpy") == "q8"
    assert _compile(tiny_pair, tmp_path / "named", "--backend", "numpy", "--numerics", "exact") == "exact"


@pytest.mark.parametrize("vnni", ["1", "0"])
def test_opencl_defaults_to_q8_exactly_where_its_cpu_tiles_have_vnni(tiny_pair, tmp_path, monkeypatch, vnni):
    opencl = get_backend("opencl")
    if opencl.unavailable_reason():
        pytest.skip(opencl.unavailable_reason())
    monkeypatch.delenv("DFLASH_IR_NUMERICS")
    monkeypatch.delenv("DFLASH_IR_PROFILE", raising=False)
    monkeypatch.setenv("DFLASH_IR_VNNI", vnni)
    # the rule from the machine's own facts: a PoCL CPU device on a host with AVX-512 VNNI
    pocl_cpu = opencl.device_is_cpu() and "Portable Computing Language" in opencl.device_description()
    host_vnni = {"avx512f", "avx512_vnni"} <= host_cpu_flags()
    want = "q8" if vnni == "1" and pocl_cpu and host_vnni else "exact"
    assert opencl.default_numerics() == want
    assert _compile(tiny_pair, tmp_path / "out", "--backend", "opencl") == want


@pytest.mark.parametrize("name", ["tvm-llvm", "tvm-opencl"])
@pytest.mark.parametrize("vnni", ["1", "0"])
def test_tvm_on_a_cpu_defaults_to_q8_exactly_where_its_nests_have_vnni(tiny_pair, tmp_path, monkeypatch, name, vnni):
    """The TVM backends follow the same rule for their loop nests (tvm-opencl: where they run,
    on a PoCL CPU device); their artifacts list the extension."""
    backend = get_backend(name)
    if backend.unavailable_reason():
        pytest.skip(backend.unavailable_reason())
    monkeypatch.delenv("DFLASH_IR_NUMERICS")
    monkeypatch.delenv("DFLASH_IR_PROFILE", raising=False)
    monkeypatch.setenv("DFLASH_IR_VNNI", vnni)
    host_vnni = {"avx512f", "avx512_vnni"} <= host_cpu_flags()
    nests_here = name == "tvm-llvm" or (backend.device_is_cpu() and "Portable Computing Language" in backend.device_description())
    want = "q8" if vnni == "1" and host_vnni and nests_here else "exact"
    assert backend.default_numerics() == want
    out = tmp_path / "out"
    assert _compile(tiny_pair, out, "--backend", name) == want
    programs = yaml.safe_load((out / MANIFEST).read_text())["programs"]
    assert all(p["backend"]["isa"] == (["avx512_vnni"] if want == "q8" else []) for p in programs.values())
