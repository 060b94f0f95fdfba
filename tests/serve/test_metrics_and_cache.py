"""Metrics bookkeeping and the -m/-md compile cache's folder names (no server)."""
import os
import shutil

from prometheus_client.parser import text_string_to_metric_families

from dflash_ir.runtime.stats import GenerationStats
from dflash_ir.serve.artifact_cache import cache_folder
from dflash_ir.serve.metrics import ServerMetrics
from dflash_ir.serve.scheduler import Finished

from .conftest import DRAFT, TARGET


def samples(metrics: ServerMetrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


def test_a_finished_job_and_the_gauges():
    m = ServerMetrics(16, busy=lambda: 3, queued=lambda: 5)
    stats = GenerationStats(prompt_tokens=9, generated_tokens=12, rounds=3, drafted=45, accepted=8)
    stats.accept_hist.update({0: 1, 3: 1, 5: 1})
    m.job_ended(Finished(stats, 0.25, 2.0, 4), "finished")
    m.job_ended(None, "cancelled")
    m.request("invalid")
    m.verified(2)  # a batched pass of two slots' blocks, then a lone block
    m.verified(1)
    got = samples(m)
    assert (got[("dflash:verify_passes_total", ())], got[("dflash:verify_blocks_total", ())]) == (2, 3)
    assert got[("llamacpp:n_decode_total", ())] == 4
    assert got[("llamacpp:requests_processing", ())] == 3 and got[("llamacpp:requests_deferred", ())] == 5
    assert got[("llamacpp:prompt_tokens_seconds", ())] == 36.0 and got[("llamacpp:predicted_tokens_seconds", ())] == 6.0
    assert [got[("llamacpp:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
            for i in range(5)] == [2, 2, 2, 1, 1]
    assert ("llamacpp:spec_decode_num_accepted_tokens_per_pos_total", (("position", "5"),)) not in got
    assert got[("dflash:round_tokens_bucket", (("le", "1.0"),))] == 1
    assert got[("dflash:round_tokens_bucket", (("le", "4.0"),))] == 2
    assert got[("dflash:round_tokens_sum", ())] / got[("dflash:round_tokens_count", ())] == stats.tau
    assert {o: got[("dflash:requests_total", (("outcome", o),))] for o in ("finished", "cancelled", "invalid",
                                                                          "failed", "rejected")} == {
        "finished": 1, "cancelled": 1, "invalid": 1, "failed": 0, "rejected": 0}
    assert not any(name.endswith("_created") for name, _ in got)


def test_the_cache_folder_changes_with_what_the_artifact_depends_on(tmp_path):
    target, draft = shutil.copy(TARGET, tmp_path / "t.gguf"), shutil.copy(DRAFT, tmp_path / "d.gguf")
    base = dict(backend="opencl", n_ctx=512, opt_level=None, numerics="exact")
    first = cache_folder(tmp_path, target, draft, **base)
    assert cache_folder(tmp_path, target, draft, **base) == first and first.parent == tmp_path
    changed = [cache_folder(tmp_path, target, draft, **{**base, "backend": "numpy"}),
               cache_folder(tmp_path, target, draft, **{**base, "n_ctx": 1024}),
               cache_folder(tmp_path, target, draft, **{**base, "opt_level": 1}),
               cache_folder(tmp_path, target, draft, **{**base, "numerics": "q8"}),
               cache_folder(tmp_path, target, None, **base)]
    st = os.stat(target)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    changed.append(cache_folder(tmp_path, target, draft, **base))
    assert len({first, *changed}) == 7


def test_a_cached_artifact_without_numerics_takes_the_backends_default(tmp_path, monkeypatch):
    """The default is resolved before the cache key: a q8 default and an explicit q8 share a
    folder, and the compile is told the mode it is keyed by."""
    import dflash_ir.artifact as artifact
    from dflash_ir.serve.artifact_cache import cached_artifact

    compiled = []

    def fake_compile(target, draft, *, out, numerics, **kw):
        compiled.append(numerics)
        out.mkdir()
    monkeypatch.setattr(artifact, "compile_pair", fake_compile)
    monkeypatch.setenv("DFLASH_IR_NUMERICS", "q8")
    where = dict(cache_dir=tmp_path, backend="numpy", n_ctx=512, n_max=None, opt_level=None,
                 progress=lambda msg: None, check=lambda folder: None)
    folder = cached_artifact(TARGET, DRAFT, numerics=None, **where)
    assert compiled == ["q8"]
    assert folder == cache_folder(tmp_path, TARGET, DRAFT, backend="numpy", n_ctx=512, opt_level=None, numerics="q8")
    assert cached_artifact(TARGET, DRAFT, numerics="q8", **where) == folder and compiled == ["q8"]
