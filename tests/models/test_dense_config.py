"""`llama` / `qwen3` targets without Transformers: config reading with llama.cpp's defaults,
what is refused (and how it is named), the tensor table, the passes on their graphs, and a
DFlash draft running speculatively on them (generated tiny files, models/generator.py)."""
import collections

import numpy as np
import pytest

from dflash_ir.artifact import open_engine, open_pair
from dflash_ir.interpreter import Interpreter
from dflash_ir.models.config import TargetConfig
from dflash_ir.models.generator import (target_plan, tiny_draft_config, tiny_target_config, write_draft, write_gguf,
                                        write_target)
from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.models.metadata import TARGET_ARCHS, ModelConfigError
from dflash_ir.models.targets import BUILDERS
from dflash_ir.models.tensors import validate_tensors
from dflash_ir.runtime.state import zero_states

DENSE = ["llama", "qwen3"]
PROMPT = [5, 77, 140, 9, 260, 31, 8, 101, 44, 203]


def _write(tmp_path, arch, edit=lambda plan: None, **overrides):
    plan = target_plan(tiny_target_config(arch, **overrides), dtype="f32", seed=1)
    edit(plan)
    return write_gguf(tmp_path / f"{arch}.gguf", plan)


def test_every_target_architecture_has_a_builder():
    assert set(BUILDERS) == set(TARGET_ARCHS)


@pytest.mark.parametrize("arch", DENSE)
def test_head_size_and_rope_base_default_as_in_llama_cpp(tmp_path, arch):
    def drop(plan):
        for key in ("attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count"):
            del plan.metadata[f"{arch}.{key}"]

    cfg = TargetConfig.from_gguf(open_gguf(_write(tmp_path, arch, drop, head_dim=16, n_rot=16)))
    assert (cfg.head_dim, cfg.n_rot, cfg.rope_theta) == (16, 16, 10000.0)  # 64 / 4 heads
    assert cfg.layer_is_recurrent == (False,) * 4 and not cfg.is_hybrid


@pytest.mark.parametrize("arch, edit, message", [
    ("llama", lambda p: p.metadata.update({"llama.rope.scaling.type": "linear"}),
     r"llama\.rope\.scaling\.type = 'linear': RoPE scaling is not supported"),
    ("llama", lambda p: p.set_tensor("rope_freqs.weight", (8,)),
     r"tensor rope_freqs\.weight must hold n_rot/2 = 16 positive finite factors .*this llama file has 8: "),
    ("llama", lambda p: p.set_tensor("rope_freqs.weight", (4, 4)), r"tensor rope_freqs\.weight must be a vector"),
    ("qwen3", lambda p: p.tensors.pop("blk.1.attn_k_norm.weight"), r"tensor blk\.1\.attn_k_norm\.weight is missing"),
    ("llama", lambda p: p.set_tensor("blk.0.attn_q_norm.weight", (32,)),
     r"unexpected tensor blk\.0\.attn_q_norm\.weight \(not part of a llama model"),
    ("llama", lambda p: p.tensors.pop("blk.2.ffn_norm.weight"), r"tensor blk\.2\.ffn_norm\.weight is missing"),
    ("llama", lambda p: p.metadata.update({"llama.rope.dimension_count": 16}),
     r"llama\.rope\.dimension_count = 16 must equal the head size 32"),
])
def test_bad_dense_files_are_refused_by_name(tmp_path, arch, edit, message):
    path = _write(tmp_path, arch, edit)
    with pytest.raises(ModelConfigError, match=message):
        f = open_gguf(path)
        validate_tensors(f, TargetConfig.from_gguf(f))


@pytest.mark.parametrize("arch", DENSE)
def test_passes_keep_logits_and_fuse_what_the_kernels_fuse(tmp_path, arch):
    """The optimised graphs compute what the unoptimised ones do, bit for bit (the
    interpreter on both); the attention becomes one fused_attention per layer: qwen3's with
    its q/k norms and NeoX RoPE, llama's without norms, RoPE on adjacent pairs."""
    path = _write(tmp_path, arch)
    plain, fused = (open_pair(path, taps=(1, 2), opt_level=level) for level in (0, 2))
    nodes = fused.graphs["target.verify"].nodes
    ops = collections.Counter(n.op for n in nodes)
    assert (ops["fused_attention"], ops["attention"], ops["rope"], ops["transpose"]) == (4, 0, 0, 0)
    layer = next(n for n in nodes if n.op == "fused_attention")
    assert (layer.attr["eps"] is None, layer.attr["pairs"]) == ((False, "halves") if arch == "qwen3" else
                                                              (True, "adjacent"))
    rows = np.arange(len(PROMPT), dtype=np.int32)
    for name, graph in plain.graphs.items():
        ids = PROMPT[:1] if name == "target.decode" else PROMPT
        inputs = {"tokens": np.asarray(ids, np.int32), "positions": rows[:len(ids)], "pos": np.int32(0),
                  "kv_len": np.int32(len(ids))} | ({} if name == "target.decode" else {"logit_rows": rows})
        states = zero_states(graph, 32)
        want = Interpreter(graph, plain.weights).run(inputs, states).outputs
        got = Interpreter(fused.graphs[name], fused.weights).run(inputs, states).outputs
        for key in ("logits", "features"):
            assert np.array_equal(got[key], want[key]), f"{arch} {name} {key}"


@pytest.mark.parametrize("arch, dtype", [("llama", "f32"), ("qwen3", "q8_0")])
def test_dflash_draft_runs_speculatively_on_dense_targets(tmp_path, arch, dtype):
    """Pair checks accept a draft tapping a dense target; speculative greedy == target-only."""
    cfg = tiny_target_config(arch)
    target = write_target(tmp_path / "target.gguf", cfg, dtype=dtype, seed=1)
    draft = write_draft(tmp_path / "draft.gguf", tiny_draft_config(cfg), target_cfg=cfg, dtype=dtype, seed=2)
    engine = open_engine(target, draft, n_ctx=96)
    want = engine.generate(prompt_ids=PROMPT, max_tokens=24, speculative=False, ignore_eos=True).tokens
    spec = engine.generate(prompt_ids=PROMPT, max_tokens=24, n_max=7, ignore_eos=True)
    assert spec.tokens == want
    assert spec.stats.rounds > 0
