"""The default numerics mode is `exact` on every backend (README: q8's quantisation launches
kernels of its own, which a small model's decode pays for): what dflash-compile writes when
--numerics is not given."""
import yaml

from dflash_ir.cli import compile as compile_cli
from dflash_ir.integrity import MANIFEST


def test_dflash_compile_defaults_to_exact_numerics(tiny_pair, tmp_path):
    target, draft = tiny_pair("qwen35", "q8_0")
    out = tmp_path / "out"
    assert compile_cli.main([str(target), str(draft), "-o", str(out), "-c", "64", "--backend", "numpy"]) == 0
    assert yaml.safe_load((out / MANIFEST).read_text())["config"]["numerics"] == "exact"
    assert not any("quantize_q8_0" in g.read_text() for g in (out / "graphs").glob("*.yaml"))
    q8 = tmp_path / "q8"
    assert compile_cli.main([str(target), str(draft), "-o", str(q8), "-c", "64", "--backend", "numpy",
                             "--numerics", "q8"]) == 0
    assert yaml.safe_load((q8 / MANIFEST).read_text())["config"]["numerics"] == "q8"
    assert any("quantize_q8_0" in g.read_text() for g in (q8 / "graphs").glob("*.yaml"))
