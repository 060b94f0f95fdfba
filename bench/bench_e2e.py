"""End to end per backend: prefill, target-only decode, speculative tokens/s and tau; llama.cpp beside"""
import pytest

from dflash_ir.benchmark.e2e import run_end_to_end
from dflash_ir.benchmark.models import demo_model, synthetic_model
from dflash_ir.benchmark.peer import peer_unavailable, run_llama_cpp

from common import bench_backends, ready_backend

MODELS = {"demo": demo_model, "synthetic": synthetic_model}
HEADER = f"{'model':10s} {'engine':18s} {'prefill':>9s} {'decode':>8s} {'spec':>8s} {'tau':>6s}   (tok/s)"
_OURS: dict[str, object] = {}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("name", bench_backends())
def test_end_to_end(benchmark, table, model, name, tmp_path):
    ready_backend(name)
    m = MODELS[model]()
    r = benchmark.pedantic(run_end_to_end, args=(name, m, tmp_path), rounds=1, iterations=1)
    _OURS.setdefault(model, r)
    table(HEADER, f"{model:10s} {name:18s} {r.prefill_tps:9.1f} {r.decode_tps:8.1f} {r.speculative_tps:8.1f} {r.tau:6.2f}")


@pytest.mark.parametrize("model", list(MODELS))
def test_llama_cpp(benchmark, table, model):
    reason = peer_unavailable()
    if reason:
        pytest.skip(reason)
    if model not in _OURS:
        pytest.skip("needs one of our end-to-end runs of this model first (same prompt ids)")
    ours = _OURS[model]
    m = MODELS[model]()
    r = benchmark.pedantic(run_llama_cpp, args=(model, m.target, ours.prompt_ids, len(ours.tokens)), rounds=1,
                           iterations=1)
    table(HEADER, f"{model:10s} {'llama.cpp':18s} {r.prefill_tps:9.1f} {r.decode_tps:8.1f} {'':>8s} {'':>6s}")
