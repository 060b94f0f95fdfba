"""The benchmark's model pairs: the shipped demo pair (real acceptance, tiny: host overhead
shows), a synthetic mid-size Qwen3.5-shaped pair (random Q8_0 weights, ~290M target
parameters: weight reads dominate, as on real models), and pairs at the real sizes of
Qwen3.5-9B and Qwen3.6-35B-A3B with their DFlash drafts (random weights, Q8_0 as generated,
Q4_K_M as llama.cpp's quantizer mixes it). Generated pairs are made on first use into the
cache (never committed) and reused."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dflash_ir.cache import cache_dir

DEMO_DIR = Path(__file__).resolve().parents[2] / "demo"


@dataclass(frozen=True)
class BenchModel:
    name: str
    target: Path
    draft: Path
    prompt: str | None          # text for models with a real tokenizer, else None: random ids
    description: str


def demo_model() -> BenchModel:
    target, draft = DEMO_DIR / "coder-target-q8_0.gguf", DEMO_DIR / "coder-dflash-q8_0.gguf"
    if not (target.is_file() and draft.is_file()):
        raise FileNotFoundError(f"the demo pair is missing from {DEMO_DIR} (retrain it with `make train-demo`)")
    prompt = json.loads((DEMO_DIR / "prompts.json").read_text())[0]["text"]
    return BenchModel("demo", target, draft, prompt, "shipped coder pair (qwen35, 4.9 MB Q8_0 target, trained draft)")


SYNTHETIC_SHAPE = dict(vocab_size=32768, hidden=1024, n_layer=16, n_head=8, n_head_kv=2, head_dim=256, n_rot=64,
                       rope_sections=(11, 11, 10, 0), ff=3584, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=16,
                       ssm_inner=2048, tied_output=True, context_length=8192)
SMALL_SHAPE = dict(vocab_size=2048, hidden=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
                   rope_sections=(3, 3, 2, 0), ff=768, ssm_d_state=32, ssm_n_group=4, ssm_dt_rank=8, ssm_inner=256,
                   tied_output=True, context_length=2048)


def synthetic_model(*, small: bool = False, progress: Callable[[str], None] = lambda msg: None) -> BenchModel:
    """The synthetic pair (`small`: a ~1M-parameter one of the same make, for smoke tests)."""
    from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target

    name = "synthetic-small" if small else "synthetic"
    shape = SMALL_SHAPE if small else SYNTHETIC_SHAPE
    folder = cache_dir("bench") / name
    target, draft = folder / "target-q8_0.gguf", folder / "dflash-q8_0.gguf"
    if not (target.is_file() and draft.is_file()):
        progress(f"generating the {name} pair into {folder} (once)")
        folder.mkdir(parents=True, exist_ok=True)
        tcfg = tiny_target_config("qwen35", **shape)
        dcfg = tiny_draft_config(tcfg, n_layer=1, n_head=8, n_head_kv=2, head_dim=128, ff=shape["ff"])
        write_draft(folder / "draft.tmp", dcfg, target_cfg=tcfg, dtype="q8_0", seed=1)
        write_target(folder / "target.tmp", tcfg, dtype="q8_0", seed=0)
        (folder / "draft.tmp").rename(draft)
        (folder / "target.tmp").rename(target)
    size = target.stat().st_size / 1e6
    return BenchModel(name, target, draft, None, f"generated qwen35 shape, random Q8_0 weights, {size:.0f} MB target")


# name -> (models.generator.REAL_TARGETS shape, target quantisation); drafts are Q8_0, as shipped
REAL_MODELS = {"qwen35-9b": ("qwen35-9b", "Q8_0"), "qwen35-9b-q4_k_m": ("qwen35-9b", "Q4_K_M"),
               "qwen36-35b-a3b-q4_k_m": ("qwen36-35b-a3b", "Q4_K_M")}


def real_model(name: str, *, progress: Callable[[str], None] = lambda msg: None) -> BenchModel:
    """A real-size pair (`REAL_MODELS`), generated into the cache on first use: the Q8_0 target
    and draft by the generator (minutes, one tensor in memory at a time), another target type
    by llama.cpp's quantizer from the Q8_0 one (llama-cpp-python needed). The Q8_0 source is
    made only while the target it is quantised to is missing, so it may be deleted after (the
    35B-A3B's is 37 GB)."""
    from dflash_ir.models.generator import real_configs, write_draft, write_target

    from .peer import peer_unavailable, quantize, usable_cpus

    shape, preset = REAL_MODELS[name]
    folder = cache_dir("bench") / shape
    q8, draft = folder / "target-q8_0.gguf", folder / "dflash-q8_0.gguf"
    tcfg, dcfg = real_configs(shape)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"target-{preset.lower()}.gguf"
    for path, write in ((draft, lambda p: write_draft(p, dcfg, target_cfg=tcfg, dtype="q8_0", seed=1)),
                        (q8, lambda p: write_target(p, tcfg, dtype="q8_0", seed=0))):
        if not path.is_file() and not (path == q8 and target.is_file()):
            progress(f"generating {path} (random weights at {shape}'s shape, once)")
            write(path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
    if not target.is_file():
        if reason := peer_unavailable():
            raise RuntimeError(f"{name}: making its {preset} target needs llama.cpp's quantizer: {reason}")
        progress(f"quantizing {q8.name} to {preset} with llama.cpp's quantizer (once)")
        quantize(q8, target.with_suffix(".tmp"), preset, threads=usable_cpus()).rename(target)
    size = target.stat().st_size / 1e9
    return BenchModel(name, target, draft, None,
                      f"{shape} shape, random weights, {preset} target {size:.1f} GB, Q8_0 DFlash draft "
                      f"{draft.stat().st_size / 1e9:.1f} GB")
