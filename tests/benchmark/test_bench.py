"""dflash-bench: the cases count what they claim, and a quick run on the CPU backends writes
the JSON, the markdown table and the plots with figures that hang together."""
import argparse
import json
import re
from pathlib import Path

import numpy as np
import pytest

from dflash_ir.artifact import open_engine
from dflash_ir.backends.base import get_backend
from dflash_ir.benchmark import cli
from dflash_ir.benchmark.kernels import gemv_case, moe_case, random_q8_0, random_weight
from dflash_ir.benchmark.models import synthetic_model
from dflash_ir.benchmark.peer import PeerCrashed, peer_unavailable, portable_build_command, run_llama_cpp
from dflash_ir.benchmark.tau import ScriptedDraft, TooSlow, run_tau_sweep
from dflash_ir.dtypes import DType
from dflash_ir.quant import dequantize


def test_gemv_case_counts_weight_and_activation_traffic():
    case = gemv_case("g", 64, 96, 3)
    assert case.family == "gemv"
    assert case.nbytes == 64 * 96 * 34 / 32 + 4 * 3 * (96 + 64)
    assert case.flops == 2 * 3 * 64 * 96
    assert case.weights["w0"].shape == (64, 96 // 32 * 34)
    assert gemv_case("g", 64, 96, 17).family == "gemm"


@pytest.mark.parametrize("rows, form", [(1, "gemv"), (3, "gemv"), (16, "gemv"), (17, "gemm")])
def test_gemv_case_gets_the_kernel_its_graph_kind_gets_in_a_model(rows, form):
    """A decode product has one static row and a verify's T rows: both take the GEMV, as in
    the model graphs; a prefill's T rows the GEMM (a symbolic T alone would get the GEMM)."""
    from dflash_ir.passes.pipeline import run_pipeline

    graph = run_pipeline(gemv_case("g", 64, 96, rows, copies=1).graph)
    [node] = [n for n in graph.nodes if n.op == "matmul_q8_0"]
    assert node.attr["form"] == form


def test_decode_gemv_reads_enough_weight_copies_to_miss_the_cache(monkeypatch):
    """One row: as many distinct weights as span twice the last-level cache, each its own
    output, all counted; a 300 MB L3 would otherwise serve a 53 MB matrix."""
    import dflash_ir.benchmark.kernels as kernels

    monkeypatch.setattr(kernels, "beyond_cache_bytes", lambda: 3 * 64 * 96 * 34 // 32)
    case = gemv_case("g", 64, 96, 1)
    assert [name for name, _ in case.graph.outputs] == ["y0", "y1", "y2"]
    assert case.nbytes == 3 * (64 * 96 * 34 / 32 + 4 * (96 + 64))
    assert [v.name for v in case.graph.inputs] == ["x", "x1", "x2"]  # one x each: no group_matmuls
    assert not np.array_equal(case.weights["w0"], case.weights["w2"])
    assert gemv_case("g", 64, 96, 3).nbytes == 64 * 96 * 34 / 32 + 4 * 3 * (96 + 64)  # verify rows: one copy


def test_random_q8_0_is_valid_storage_with_the_stated_scale():
    storage = random_q8_0(np.random.default_rng(0), (4, 128))
    values = dequantize(storage, DType.Q8_0)
    d = np.float32(np.float16(1 / (127 * np.sqrt(128))))
    assert values.shape == (4, 128)
    assert np.all(np.abs(values) <= 127 * d + 1e-9)
    assert np.allclose(values / d, np.round(values / d))  # integer multiples of the block scale
    assert 34 * 128 // 32 == storage.shape[1]


@pytest.mark.parametrize("dtype", [DType.Q4_K, DType.Q6_K])
def test_random_k_quant_weights_decode_to_values_of_order_one_over_sqrt_k(dtype):
    """The Q4_K_M cases' weights: every block's f16 scales set (random bytes there could be
    inf or NaN), values ~ 1/sqrt(K) as the Q8_0 cases'."""
    storage = random_weight(np.random.default_rng(0), (8, 1024), dtype)
    values = dequantize(storage, dtype)
    assert values.shape == (8, 1024) and storage.shape == (8, 1024 // 256 * dtype.block_bytes)
    assert np.all(np.isfinite(values)) and 0.1 < np.std(values) * np.sqrt(1024) < 10


def test_a_q4_k_m_moe_case_moves_its_experts_bytes_as_stored():
    """One row's top-2 and the shared expert: three experts' gate and up (Q4_K, 144 bytes a
    256-block) and down (Q6_K, 210 bytes), the f16 router, x in and y out."""
    case = moe_case("m", 1, width=256, ff=256, experts=4, k=2, dtype=DType.Q4_K, down=DType.Q6_K)
    assert [case.weights[n].shape[-1] for n in ("gate_exps", "down_exps", "sh_up")] == [144, 210, 144]
    assert case.nbytes == 3 * 256 * 256 * (2 * 144 + 210) / 256 + 4 * 256 * 2 + 8 * 256


def _cpu_backends() -> list[str]:
    return ["numpy"] + ([] if get_backend("opencl").unavailable_reason() else ["opencl"])


def test_quick_run_writes_consistent_json_markdown_and_plots(tmp_path):
    backends = _cpu_backends()
    out = tmp_path / "out"
    code = cli.main(["--quick", "-b", ",".join(backends), "--suites", "limits,kernels,e2e", "--models", "synthetic",
                     "-o", str(out)])
    assert code == 0
    r = json.loads((out / "results.json").read_text())
    assert r["failures"] == []
    assert [l["backend"] for l in r["limits"]] == ["host", *backends]
    assert all(r["backends"][b]["cpu"] for b in backends)
    assert all(l["copy_gbs"] > 0 and l["triad_gbs"] > 0 and l["gemm_gflops"] > 0 for l in r["limits"])
    assert len(r["kernels"]) == 5 * len(backends)
    for k in r["kernels"]:
        assert k["gbs"] == pytest.approx(k["bytes"] / (k["ms"] / 1e3) / 1e9)
        # every backend here runs on the host CPU: the better of its own streams and the host's
        bandwidth = max(l[f] for l in r["limits"] if l["backend"] in (k["backend"].split("/")[0], "host")
                        for f in ("copy_gbs", "triad_gbs"))
        assert k["fraction_bw"] == pytest.approx(k["gbs"] / bandwidth)
    runs = r["e2e"]
    assert [e["backend"] for e in runs] == backends
    assert all(e["tau"] >= 1 and e["decode_tps"] > 0 and e["speculative_tps"] > 0 and e["adaptive_tps"] > 0
               and e["verify16_steps"] > 0 for e in runs)
    assert all(e["tokens"] == runs[0]["tokens"] for e in runs)  # greedy: every backend, the same tokens
    md = (out / "results.md").read_text()
    assert "## Kernels" in md and "## End to end (greedy)" in md and "| synthetic-small | numpy |" in md
    assert "verify-16 (decode steps)" in md
    for png in ("throughput.png", "roofline.png", "speedup_vs_tau.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kernels_run_in_each_numerics_mode_asked_for(tmp_path, monkeypatch):
    """A kernel row is measured as dflash-compile would build it in that mode: q8 quantises
    the product's activations, exact does not."""
    if reason := get_backend("opencl").unavailable_reason():
        pytest.skip(f"opencl: {reason}")
    import dflash_ir.benchmark.programs as programs
    built = []

    def recording(graph, **kw):
        out = run_pipeline(graph, **kw)
        built.append((kw["numerics"], graph.name, {n.op for n in out.nodes}))
        return out
    run_pipeline = programs.run_pipeline
    monkeypatch.setattr(programs, "run_pipeline", recording)
    out = tmp_path / "out"
    assert cli.main(["--quick", "-b", "opencl", "--suites", "kernels", "--numerics", "exact,q8", "-o", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    assert r["failures"] == []
    assert [k["backend"] for k in r["kernels"]] == ["opencl", "opencl/q8"] * 5
    products = [(numerics, "quantize_q8_0" in ops) for numerics, name, ops in built if "gem" in name]
    assert products == [("exact", False), ("q8", True)] * 2


@pytest.mark.parametrize("replayed", [False, True])
def test_a_q8_decode_product_over_several_weights_keeps_its_inputs_when_replayed(tmp_path, replayed):
    """The kernels suite's decode GEMV has one x per weight copy; in q8 each x is quantised
    by a launch of its own, and the memory plan gives a later quantisation the slot of an x
    already read. A replay would read that x overwritten, so the launcher refused the graph
    and `dflash-bench --suites kernels` lost its three GEMV figures on a VNNI CPU (q8 there
    by default). Compiled as `replayed` (what the suite's runner does), every input keeps its
    slot to itself and the launcher replays it."""
    import dataclasses

    from dflash_ir.benchmark.programs import single_graph_runner
    from dflash_ir.passes.pipeline import run_pipeline
    from dflash_ir.passes.plan_memory import REPLAYED

    backend = get_backend("opencl")
    if reason := backend.unavailable_reason():
        pytest.skip(f"opencl: {reason}")
    case = gemv_case("g", 64, 96, 1, copies=3)
    graph = dataclasses.replace(case.graph, meta=case.graph.meta + ((REPLAYED, replayed),))
    graph = run_pipeline(graph, level=backend.default_opt_level, numerics="q8")
    slots = backend.load(graph, backend.compile(graph, tmp_path), tmp_path, lambda w: case.weights[w.tensor]).plan.buffers
    shared = {x: sorted(n for n, s in slots.items() if n != x and s == slots[x]) for x in case.inputs}
    assert any(shared.values()) != replayed, shared
    call = single_graph_runner(backend, case.graph, case.weights, case.inputs, {}, tmp_path / "suite", "q8")
    call()
    call()


def test_tau_lists_take_values_and_ranges_within_the_block():
    assert cli._taus("1,4-6,16") == (1, 4, 5, 6, 16)
    with pytest.raises(argparse.ArgumentTypeError, match="must lie in 1..16"):
        cli._taus("0-3")


def test_unknown_backend_or_suite_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="unknown backend.*nope.*known: "):
        cli.main(["-b", "nope", "-o", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown suite.*speed"):
        cli.main(["--suites", "speed", "-b", "numpy", "-o", str(tmp_path)])


def test_llama_cpp_greedy_tokens_equal_ours_on_the_synthetic_model(tmp_path):
    """llama.cpp is an independent implementation reading the same GGUF."""
    reason = peer_unavailable()
    if reason:
        pytest.skip(reason)
    from dflash_ir.benchmark.e2e import run_end_to_end

    model = synthetic_model(small=True)
    ours = run_end_to_end("numpy", model, tmp_path, max_tokens=12)
    try:
        theirs = run_llama_cpp(model.name, model.target, ours.prompt_ids, len(ours.tokens))
    except PeerCrashed as e:  # an install that does not run on this CPU, not a wrong answer
        pytest.skip(str(e))
    assert theirs.tokens == ours.tokens
    assert theirs.prefill_tps > 0 and theirs.decode_tps > 0 and theirs.verify16_steps > 0


@pytest.mark.parametrize("cpu, wanted, refused", [
    ({"avx2", "avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16"},  # a Zen 4: no AVX-VNNI
     {"GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"}, {"GGML_AVX_VNNI"}),
    ({"avx2", "avx_vnni"}, {"GGML_AVX_VNNI"}, {"GGML_AVX512", "GGML_AVX512_VNNI"}),  # an Alder Lake
    ({"avx2"}, set(), {"GGML_AVX512", "GGML_AVX_VNNI"})])
def test_llama_cpp_rebuild_turns_on_only_the_extensions_the_cpu_lists(monkeypatch, cpu, wanted, refused):
    import dflash_ir.benchmark.peer as peer
    monkeypatch.setattr(peer, "host_cpu_flags", lambda: frozenset(cpu))
    on = set(re.findall(r"-D(GGML_\w+)=ON", portable_build_command()))
    assert wanted <= on and not refused & on and "GGML_NATIVE" not in on and not any("AMX" in o for o in on)


def test_tau_suite_measures_every_acceptance_length_with_both_lengths(tmp_path):
    """The scripted draft's tau sweep: a point per tau with target-only, fixed-length and
    cost-aware tokens/s, the round costs it used, a table and the plot."""
    out = tmp_path / "out"
    assert cli.main(["--quick", "-b", "opencl" if "opencl" in _cpu_backends() else "numpy", "--suites", "tau",
                     "--models", "synthetic", "--taus", "1,16", "-o", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    assert r["failures"] == [] and [t["tau"] for t in r["tau"]] == [1, 16]
    for t in r["tau"]:
        assert t["decode_tps"] > 0 and t["fixed_speedup"] == pytest.approx(t["fixed_tps"] / t["decode_tps"])
        assert t["adaptive_speedup"] == pytest.approx(t["adaptive_tps"] / t["decode_tps"])
        assert sum(t["lengths"].values()) >= t["tokens"] // 16
    (costs,) = r["costs"]
    assert len(costs["verify_ms"]) == 16 and costs["decode_ms"] > 0 and costs["draft_ms"] > 0
    md = (out / "results.md").read_text()
    assert "## Speed-up vs tau (scripted draft)" in md and "## Round costs (measured at load)" in md
    assert (out / "speedup_vs_tau.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_that_cannot_fit_its_time_box_is_refused(tmp_path):
    with pytest.raises(TooSlow, match="too slow for a tau sweep in 0 s"):
        run_tau_sweep("numpy", synthetic_model(small=True), tmp_path, seconds=1e-3)


def test_scripted_draft_makes_every_round_accept_tau_minus_one(tiny_pair):
    """Its proposals follow the target's greedy continuation for tau-1 positions per block
    while the draft network itself runs every round."""
    engine = open_engine(*tiny_pair("qwen35"), n_ctx=96)
    prompt = [5, 77, 140, 9, 260, 31, 8]
    want = engine.generate(prompt_ids=prompt, max_tokens=50, speculative=False, ignore_eos=True).tokens
    network, ran = engine.draft, []
    network.propose = lambda anchor, run=network.propose: ran.append(anchor) or run(anchor)
    for tau in (1, 4, 16):
        engine.draft = ScriptedDraft(network, prompt + want, tau - 1)
        gen = engine.generate(prompt_ids=prompt, max_tokens=30, n_max=7, ignore_eos=True)
        assert gen.tokens == want[:30]
        assert [r["accepted"] for r in gen.rounds] == [min(tau - 1, 7)] * len(gen.rounds)
        assert ran[-len(gen.rounds):] == [r["anchor"] for r in gen.rounds]
    engine.draft = ScriptedDraft(network, prompt + want[:20], 3)
    with pytest.raises(IndexError, match="the scripted continuation ends at position 27"):
        engine.generate(prompt_ids=prompt, max_tokens=30, n_max=7, ignore_eos=True)


def test_serve_suite_batches_the_verify_blocks_of_concurrent_requests(tmp_path):
    """1, 2 and 4 requests at once, batched and one by one (the suite itself checks every
    request's tokens against its single-client greedy run): with 2 and 4 requests a batched
    run verifies the same blocks in fewer target passes; one request runs the same either way."""
    out = tmp_path / "out"
    assert cli.main(["--quick", "-b", "opencl" if "opencl" in _cpu_backends() else "numpy", "--suites", "serve",
                     "--models", "synthetic", "-o", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    assert r["failures"] == []
    points = {(p["clients"], p["batched"]): p for p in r["serve"]}
    assert sorted(points) == [(n, b) for n in (1, 2, 4) for b in (False, True)]
    for (clients, batched), p in points.items():
        assert p["tokens"] == clients * 16 and p["tps"] == pytest.approx(p["tokens"] / p["seconds"])
        if clients == 1 or not batched:
            assert p["verify_passes"] == p["verified_blocks"]
        else:
            assert p["verify_passes"] < p["verified_blocks"]
    assert "## dflash-serve: concurrent requests" in (out / "results.md").read_text()


def test_scale_suite_measures_compile_loads_memory_and_speed_in_processes_of_their_own(tmp_path):
    out = tmp_path / "out"
    backend = "opencl" if "opencl" in _cpu_backends() else "numpy"
    assert cli.main(["--quick", "-b", backend, "--suites", "scale", "--models", "synthetic", "--repeats", "2",
                     "--bursts", "3", "-o", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    assert r["failures"] == []
    model = synthetic_model(small=True)
    engines = list(dict.fromkeys(x["engine"] for x in r["scale"]))
    assert [(x["engine"], x["repeat"]) for x in r["scale"]] == [(e, i) for i in range(2) for e in engines]  # alternating
    ours_each = [x for x in r["scale"] if x["engine"].split("/")[0] == backend]
    assert [x["compile_s"] is not None for x in ours_each] == [True, False]  # compiled once
    rows = {x["engine"].split()[0]: x for x in r["scale"] if x["repeat"] == 0}
    ours = rows[backend]
    assert ours["file_bytes"] == model.target.stat().st_size + model.draft.stat().st_size
    assert ours["compile_s"] > 0 and ours["cold_load_s"] > 0 and ours["warm_load_s"] > 0
    assert ours["prefill_tps"] > 0 and ours["decode_tps"] > 0 and ours["verify16_steps"] > 0
    assert ours["peak_rss_bytes"] > ours["file_bytes"]  # the weights were resident in that process
    assert ours["rss_over_need"] == pytest.approx(ours["peak_rss_bytes"] / (ours["file_bytes"] + ours["state_bytes"]))
    if peer_unavailable() is None:
        theirs = rows["llama.cpp"]
        assert theirs["compile_s"] is None and theirs["state_bytes"] is None
        assert theirs["file_bytes"] == model.target.stat().st_size and theirs["peak_rss_bytes"] > theirs["file_bytes"]
        assert "Decode against llama.cpp's in the same alternation" in (out / "results.md").read_text()
        (bursts,) = r["bursts"]  # both engines loaded at once, decoding in turns
        assert (bursts["model"], bursts["engine"], bursts["tokens"]) == (model.name, ours["engine"], 16)
        assert len(bursts["decode_tps"]) == len(bursts["peer_decode_tps"]) == 3
        assert bursts["ratios"] == pytest.approx([a / b for a, b in zip(bursts["decode_tps"], bursts["peer_decode_tps"])])
        assert bursts["median_ratio"] == pytest.approx(sorted(bursts["ratios"])[1])
        assert "Decode in turns with llama.cpp" in (out / "results.md").read_text()
    else:
        assert r["bursts"] == []
    assert "## Scale: compile, load, memory and speed" in (out / "results.md").read_text()


def test_decode_bursts_run_only_where_both_engines_fit_in_memory():
    from dflash_ir.benchmark.scale import bursts_unfit

    rows = [{"engine": "opencl/q8", "peak_rss_bytes": 8e9}, {"engine": "llama.cpp 0.3", "peak_rss_bytes": 9e9},
            {"engine": "opencl/q8", "peak_rss_bytes": 7e9}]
    assert bursts_unfit(rows, "opencl/q8", 17e9) is None
    assert bursts_unfit(rows, "opencl/q8", 16.9e9) == ("both engines loaded at once need 17.0 GB (their peak RSS), "
                                                       "16.9 GB are available")
    assert bursts_unfit(rows, "vulkan", 100e9) == "this run has no peak RSS of vulkan (its scale run failed)"
    assert bursts_unfit(rows[:1], "opencl/q8", 100e9) == "this run has no peak RSS of llama.cpp (its scale run failed)"


def test_a_resident_child_that_cannot_load_names_the_work_and_its_error(tmp_path):
    from dflash_ir.benchmark.child import Resident

    with pytest.raises(RuntimeError, match=r"(?s)loading nothing failed \(exit 1\): .*no manifest.yaml: not a dflash-ir artifact"):
        Resident("dflash_ir.benchmark.scale", {"artifact": str(tmp_path / "none")}, "loading nothing", 120)


def test_decode_is_compared_with_llama_cpps_of_the_same_alternation():
    from dflash_ir.benchmark.scale import decode_against_peer

    def row(engine, model, repeat, tps):
        return {"engine": engine, "model": model, "repeat": repeat, "decode_tps": tps}

    rows = [row("opencl/q8", "a", 0, 6.0), row("llama.cpp 0.3", "a", 0, 5.0),
            row("opencl/q8", "a", 1, 4.0), row("llama.cpp 0.3", "a", 1, 5.0),
            row("opencl/q8", "a", 2, 9.0), row("llama.cpp 0.3", "a", 2, 6.0),
            row("opencl/q8", "b", 0, 3.0)]  # no llama.cpp run of model b
    a, b = decode_against_peer(rows)
    assert (a["model"], a["engine"], a["decode_tps"], a["peer_decode_tps"]) == ("a", "opencl/q8", [6.0, 4.0, 9.0],
                                                                                [5.0, 5.0, 6.0])
    assert a["ratios"] == pytest.approx([1.2, 0.8, 1.5]) and a["median_ratio"] == pytest.approx(1.2)
    assert b["ratios"] == [] and b["median_ratio"] is None


def test_repeats_below_one_and_negative_bursts_are_refused(capsys):
    for flag, value, says in (("--repeats", "0", "at least 1"), ("--bursts", "-1", "0 or more")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["--suites", "scale", flag, value])
        assert exit_.value.code == 2 and f"{flag} must be {says}, not {value}" in capsys.readouterr().err


def test_evict_drops_a_file_from_the_page_cache(tmp_path):
    """What makes a load cold: checked with util-linux's fincore, which counts a file's resident pages."""
    import shutil
    import subprocess

    from dflash_ir.benchmark.scale import evict

    if shutil.which("fincore") is None:
        pytest.skip("fincore (util-linux) is not installed")
    f = tmp_path / "weights.bin"
    f.write_bytes(np.random.default_rng(0).bytes(32 << 20))
    f.read_bytes()

    def resident() -> int:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(f)], capture_output=True,
                             text=True, check=True).stdout
        return int(out.split()[0])

    assert resident() > 16 << 20
    evict([f])
    assert resident() < 1 << 20


def test_peak_rss_counts_memory_the_process_touched():
    from dflash_ir.benchmark.measure import peak_rss

    import mmap

    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts at the current resident set
    before = peak_rss()
    # 64 MiB of fresh pages, every one written (a numpy array may reuse pages an allocator kept)
    touched = mmap.mmap(-1, 64 << 20)
    touched.write(b"\1" * len(touched))
    assert peak_rss() >= before + len(touched) - (1 << 20)


def test_quantizing_a_large_file_may_take_longer_than_the_other_requests(tmp_path, monkeypatch):
    """The 35B-A3B's 37 GB took 20 min to quantise on 2 cores: the child's time limit grows
    with the source (a sparse file here), while a small one keeps the common limit."""
    import dflash_ir.benchmark.peer as peer
    limits = []
    monkeypatch.setattr(peer, "run_child", lambda module, request, what, timeout_s, died: limits.append(timeout_s))
    for size in (1 << 20, 37 << 30):
        src = tmp_path / f"{size}.gguf"
        with open(src, "wb") as f:
            f.truncate(size)
        peer.quantize(src, tmp_path / "out.gguf", "Q4_K_M")
    assert limits[0] == peer.PEER_TIMEOUT_S
    assert limits[1] >= 2 * (37 << 30) / 31e6  # twice the time it took


def test_llama_cpp_requantizes_a_q8_0_file_to_its_q4_k_m_mix(tmp_path):
    """How the real-size Q4_K_M targets are made: from the generated Q8_0 file, not a 2x larger F16 one."""
    from dflash_ir.benchmark.peer import quantize
    from dflash_ir.models.gguf_file import open_gguf

    reason = peer_unavailable()
    if reason:
        pytest.skip(reason)
    model = synthetic_model(small=True)
    try:
        made = quantize(model.target, tmp_path / "q4_k_m.gguf", "Q4_K_M")
    except PeerCrashed as e:
        pytest.skip(str(e))
    with open_gguf(made) as f:
        types = {t.dtype for t in f.tensors.values()}
    assert {DType.Q4_K, DType.Q6_K} <= types


def test_numerics_lists_name_known_modes_once():
    assert cli._numerics("exact,q8,exact") == ("exact", "q8")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown numerics mode.*fp4.*known: exact, q8"):
        cli._numerics("q8,fp4")


def test_end_to_end_in_q8_compiles_a_q8_artifact_and_labels_its_run(tmp_path):
    """A q8 run is its own artifact (manifest numerics q8) and row (BACKEND/q8), and its
    speculative tokens still equal its target-only tokens (run_end_to_end raises otherwise)."""
    import yaml

    from dflash_ir.benchmark.e2e import run_end_to_end

    backend = "numpy"  # the interpreter: PoCL would build every q8 kernel first, minutes on a cold cache
    model = synthetic_model(small=True)
    row = run_end_to_end(backend, model, tmp_path, max_tokens=6, numerics="q8")
    assert row.backend == f"{backend}/q8" and row.decode_tps > 0 and row.generated_tokens == 6
    (artifact,) = tmp_path.iterdir()
    assert artifact.name == f"{model.name}-{backend}-q8-512"
    assert yaml.safe_load((artifact / "manifest.yaml").read_text())["config"]["numerics"] == "q8"
