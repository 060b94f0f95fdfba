"""`make demo` (dflash_ir/demo.py) on the coder pair (the SmolLM2 pair's requests:
tests/train/test_demo_pair.py): it compiles, and each request's speculative answer is printed
beside the target-only one, identical, with its tau and speed-ups (every round at n_max, and the
cost-aware length)."""
import re

import pytest

from dflash_ir import demo


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


def test_coder_pair_on_the_interpreter(own_cache, capsys):
    assert demo.main(["--pair", "coder", "--backend", "numpy", "-n", "12"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("demo: ") and "tau" in line]
    assert [line.split()[1] for line in lines] == ["completion", "chat"]
    assert all("outputs identical (greedy)" in line for line in lines), out
    assert out.count("=== completion, speculative ===") == out.count("=== completion, target-only ===") == 1
    assert out.count("--- completion, cost-aware: stats ---") == 1 and "=== completion, cost-aware" not in out
    assert all(float(re.search(r"tau (\S+),", line).group(1)) >= 1 for line in lines)  # every round at n_max


def test_a_missing_draft_says_how_to_make_it(monkeypatch, tmp_path):
    pair = demo.PAIRS["coder"]
    monkeypatch.setitem(demo.PAIRS, "coder", demo.DemoPair(pair.name, pair.title, pair.target,
                                                           tmp_path / "gone.gguf", pair.retrain, pair.requests))
    with pytest.raises(SystemExit, match=r"gone.gguf is missing; make it with `make train-demo`"):
        demo.main(["--pair", "coder", "--backend", "numpy"])
