"""A draft's reduced vocabulary: llama.cpp's `d2t` tensor (FR-Spec's frequency-ranked draft
head). The draft carries its own `output.weight` holding `draft_vocab` rows of the target's
output head, copied byte for byte, and `d2t[i]` (I64) is the target token id that row i
proposes.

Why: the head is most of a block pass when the vocabulary is large against the draft. A
SmolLM2-135M draft block multiplies 15 rows by a 49152 x 576 head, ~60% of the pass on a
2-core CPU; Qwen3.5's head has 248320 rows. Output is unchanged: the target verifies every
proposal, and a token outside the reduced vocabulary is never proposed, only accepted less.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from dflash_ir.dtypes import DType

from .config import TargetConfig
from .generator import GGUFPlan, PlannedTensor, write_gguf
from .gguf_file import GGUFFile
from .metadata import ModelConfigError
from .tensors import D2T

DRAFT_HEAD = "output.weight"


def read_d2t(draft: GGUFFile, target_vocab: int) -> np.ndarray:
    """The draft's d2t ids, checked: distinct target token ids (a wrong id would make the
    draft propose tokens the target cannot embed)."""
    ids = np.asarray(draft.raw(D2T), np.int64)
    bad = ids[(ids < 0) | (ids >= target_vocab)]
    if bad.size:
        raise ModelConfigError(f"{draft.path}: tensor {D2T} holds ids outside the target vocabulary 0..{target_vocab - 1} "
                               f"(first: {int(bad[0])})")
    repeats = ids.size - np.unique(ids).size
    if repeats:
        raise ModelConfigError(f"{draft.path}: tensor {D2T} names a target token twice ({repeats} repeats)")
    return ids


def frequent_tokens(tokens: Iterable[int], size: int, *, always: Iterable[int] = ()) -> np.ndarray:
    """The `size` most frequent ids of `tokens` (ties to the lower id), with `always` among
    them, ascending: a reduced vocabulary chosen from text the target writes."""
    always = sorted(set(int(t) for t in always))
    if len(always) > size:
        raise ValueError(f"a vocabulary of {size} tokens cannot hold the {len(always)} always kept")
    counts = np.bincount(np.fromiter(tokens, np.int64))
    ranked = [int(t) for t in np.lexsort((np.arange(counts.size), -counts)) if counts[t] and t not in always]
    return np.array(sorted(always + ranked[:size - len(always)]), np.int64)


def without_reduced_vocab(draft: GGUFFile) -> GGUFPlan:
    """The draft file's metadata and tensors as stored, less a reduced head (so it borrows the
    target's whole head, as before d2t)."""
    dropped = (DRAFT_HEAD, D2T) if D2T in draft.tensors else ()
    return GGUFPlan(dict(draft.metadata), {name: PlannedTensor(draft.raw(name), info.dtype, shape=info.shape)
                                           for name, info in draft.tensors.items() if name not in dropped})


def reduced_draft_plan(draft: GGUFFile, target: GGUFFile, ids: np.ndarray) -> GGUFPlan:
    """The draft file with a reduced head for `ids` (one it had before is replaced)."""
    return with_reduced_vocab(without_reduced_vocab(draft), target, TargetConfig.from_gguf(target), ids)


def write_frequent_head(draft: GGUFFile, target: GGUFFile, tokens: np.ndarray, size: int, out, *,
                        always: Iterable[int]) -> tuple[int, float]:
    """`draft` written to `out` with a head of the `size` target tokens most frequent in
    `tokens` and `always` (the end of generation): (rows, the share of `tokens` they hold)."""
    tokens = np.asarray(tokens, np.int64)
    ids = frequent_tokens(tokens, size, always=always)
    write_gguf(out, reduced_draft_plan(draft, target, ids))
    return len(ids), float(np.isin(tokens, ids).mean())


def with_reduced_vocab(plan: GGUFPlan, target: GGUFFile, target_cfg: TargetConfig, ids: np.ndarray) -> GGUFPlan:
    """`plan` (a draft's) with its own head: the target head's rows at `ids`, as stored, and d2t."""
    ids = np.asarray(ids, np.int64)
    if ids.ndim != 1 or not ids.size or np.unique(ids).size != ids.size or ids.min() < 0 \
            or ids.max() >= target_cfg.vocab_size:
        raise ValueError(f"a reduced vocabulary is distinct ids in 0..{target_cfg.vocab_size - 1}")
    head = target.tensor(target_cfg.head_tensor)
    rows = np.ascontiguousarray(target.raw(head.name)[ids])
    plan.tensors[DRAFT_HEAD] = PlannedTensor(rows, head.dtype, shape=(ids.size, target_cfg.hidden))
    plan.tensors[D2T] = PlannedTensor(ids, DType.I64)
    return plan
