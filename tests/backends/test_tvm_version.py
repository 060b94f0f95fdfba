"""Version pinning of TVM-built artifacts: a tvm-llvm library loads only with the apache-tvm
that built it, on the CPU it was built for (a clear ArtifactError naming both and the fix
otherwise), a TVM of another version refuses to compile, and tvm-opencl artifacts load and run without TVM."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dflash_ir.backends.base import BackendUnavailable
from kernel_cases import CASES, case_graph
from dflash_ir.backends.tvm import version
from dflash_ir.errors import ArtifactError
from dflash_ir.interpreter import Interpreter
from dflash_ir.serialize import dump_yaml


def _case(name="swiglu_broadcast"):
    c = CASES[name].build()
    return c, case_graph(c)


def test_entry_pins_the_building_tvm_and_cpu(tvm, tmp_path):
    import tvm as apache_tvm

    _, graph = _case()
    entry = tvm.compile(graph, tmp_path)
    cpu = str(apache_tvm.target.codegen.llvm_get_system_cpu())
    assert entry["tvm"] == {"version": version.PINNED, "target": {"kind": "llvm", "mcpu": cpu}}


def test_library_built_for_another_cpu_is_refused_by_name(tvm, tmp_path):
    c, graph = _case()
    entry = tvm.compile(graph, tmp_path)
    entry["tvm"]["target"]["mcpu"] = "znver9"
    with pytest.raises(ArtifactError, match=r"built for the CPU 'znver9' and this one is .*recompile"):
        tvm.load(graph, entry, tmp_path, lambda w: c.weights[w.tensor])


def test_library_from_another_tvm_is_refused_by_name(tvm, tmp_path):
    c, graph = _case()
    entry = tvm.compile(graph, tmp_path)
    entry["tvm"]["version"] = "0.26.0"
    with pytest.raises(ArtifactError, match=r"built by apache-tvm 0\.26\.0.*apache-tvm 0\.27\.0\.post1 is installed.*"
                                            r"pip install apache-tvm==0\.26\.0"):
        tvm.load(graph, entry, tmp_path, lambda w: c.weights[w.tensor])


def test_other_installed_tvm_refuses_the_library_by_name(tvm, monkeypatch, tmp_path):
    c, graph = _case()
    entry = tvm.compile(graph, tmp_path)
    monkeypatch.setattr(version, "installed", lambda: "0.28.0")
    with pytest.raises(ArtifactError, match=r"built by apache-tvm 0\.27\.0\.post1.*apache-tvm 0\.28\.0 is installed.*"
                                            r"pip install apache-tvm==0\.27\.0\.post1"):
        tvm.load(graph, entry, tmp_path, lambda w: c.weights[w.tensor])


def test_other_installed_tvm_refuses_to_compile(tvm, monkeypatch, tmp_path):
    monkeypatch.setattr(version, "installed", lambda: "0.25.0")
    assert tvm.unavailable_reason() == ("apache-tvm 0.25.0 is installed but this backend is built for 0.27.0.post1 "
                                        "(pip install apache-tvm==0.27.0.post1)")
    with pytest.raises(BackendUnavailable, match="pip install apache-tvm==0.27.0.post1"):
        tvm.compile(_case()[1], tmp_path)


def test_missing_tvm_is_named_with_its_package(monkeypatch):
    monkeypatch.setattr(version, "installed", lambda: None)
    assert version.unavailable_reason() == "apache-tvm is not installed (pip install apache-tvm==0.27.0.post1)"


def test_opencl_artifact_runs_without_tvm(tvm_opencl, tmp_path):
    """Compiled here with TVM, loaded and run in a process where `import tvm` fails."""
    c, graph = _case("rmsnorm_w_f16")
    entry = tvm_opencl.compile(graph, tmp_path)
    np.savez(tmp_path / "data.npz", **{f"in_{k}": v for k, v in c.inputs.items()},
             **{f"w_{k}": v for k, v in c.weights.items()})
    want = Interpreter(graph, lambda w: c.weights[w.tensor]).run(c.inputs, c.states).outputs
    np.savez(tmp_path / "want.npz", **want)
    (tmp_path / "entry.json").write_text(json.dumps(entry))
    (tmp_path / "graph.yaml").write_text(dump_yaml(graph))
    script = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        import numpy as np
        sys.modules["tvm"] = None  # any import of TVM now fails
        from dflash_ir.backends.base import get_backend
        from dflash_ir.serialize import load_yaml
        folder = Path({str(tmp_path)!r})
        graph = load_yaml((folder / "graph.yaml").read_text())
        data = np.load(folder / "data.npz")
        program = get_backend("tvm-opencl").load(graph, json.loads((folder / "entry.json").read_text()), folder,
                                                 lambda w: data["w_" + w.tensor])
        got = program.run({{k[3:]: data[k] for k in data if k.startswith("in_")}}, {{}}).outputs
        want = np.load(folder / "want.npz")
        assert "tvm" not in sys.modules or sys.modules["tvm"] is None
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5 * np.abs(want[k]).max())
        print("ran without tvm")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "ran without tvm" in done.stdout
