"""The benchmark's model pairs: the shipped demo pair (real acceptance, tiny: host overhead
shows) and a synthetic mid-size Qwen3.5-shaped pair (random Q8_0 weights, ~290M target
parameters: weight reads dominate, as on real models). The synthetic pair is generated on
first use into the cache (never committed) and reused."""
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
