import re

from dflash_ir.passes.report import main


def totals(text, graph):
    """{row: (-O0 count, -O2 count)} of the op table printed for `graph`."""
    section = text.split(f"{graph}: ")[1].split("\n\n")[0]
    return {row: (int(a), int(b)) for row, a, b in re.findall(r"^  (\S+) +(\d+) +(\d+)$", section, re.M)}


def test_report_prints_op_counts_and_memory(tiny_models, capsys):
    pair = tiny_models("qwen35moe", "q8_0")
    target, draft = (str(pair.files[r].path) for r in ("target", "draft"))
    assert main([target, draft, "--rows", "8", "--prefill-rows", "32", "--ctx", "64"]) == 0
    text = capsys.readouterr().out
    verify, block = totals(text, "target.verify"), totals(text, "draft.block")
    assert verify["fused_attention"] == (0, 1) and verify["fused_moe"] == (0, 4) and verify["dequantize"][1] == 0
    assert block["fused_attention"] == (0, 2)
    for t in (verify, block):
        assert t["kernels"][1] < t["kernels"][0] <= t["total"][0]
    memory = re.findall(r"own buffers +([\d.]+) MiB, planned +([\d.]+) MiB \(\d+%\), states +([\d.]+) MiB", text)
    assert len(memory) == 2 and all(float(after) < float(before) for before, after, _ in memory)
    assert memory[0][2] == memory[1][2] != "0.000"  # the same caches at both sizes
    assert "target.prefill   (C=64, R=1, T=32)" in text
