"""What compiling and loading check about a pair beyond its files: the context and draft
lengths asked for, the tokenizer and chat template (built at compile time, so a file that
compiles loads), the weights every graph reads (present in its GGUF, with the type and
shape the graph declares), and the memory all of it needs (dflash_ir/memory.py)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from .errors import ArtifactError
from .ir import Graph, Weight
from .memory import MemoryNeed, check_memory, memory_need
from .models.checks import MAX_POSITIONS
from .quant import storage_shape

SAMPLE_CHAT = [{"role": "user", "content": "Hi"}]


def resolve_lengths(configs: Mapping[str, Any], n_ctx: int, n_max: int | None,
                    default_n_max: int) -> tuple[int, int]:
    """(context, proposals per round) as compiled: n_ctx 0 takes the target's trained
    context (llama.cpp's -c 0); n_max None `default_n_max` (at most block size - 1), 0
    drafts nothing by default (target-only rounds); without a draft n_max is 0."""
    if n_ctx == 0:
        n_ctx = configs["target"].context_length
    if not 1 <= n_ctx <= MAX_POSITIONS:
        raise ValueError(f"the context size must be in 1..{MAX_POSITIONS} (0: the model's own), got {n_ctx}")
    if "draft" not in configs:
        return n_ctx, 0
    block = configs["draft"].block_size
    n_max = min(default_n_max, block - 1) if n_max is None else n_max
    if not 0 <= n_max < block:
        raise ValueError(f"--spec-draft-n-max must be in 0..{block - 1} for the draft's block size {block} "
                         f"(0: no drafting), got {n_max}")
    return n_ctx, n_max


def check_text_processing(metadata: Mapping[str, Any], source: str) -> None:
    """Build the tokenizer and compile the chat template (rendering one user turn) as the
    runtime will: TokenizerError or ChatTemplateError naming the file and the key."""
    from .models.chat_template import ChatTemplate
    from .models.tokenizer import Tokenizer

    Tokenizer.from_metadata(metadata, source=source)
    if "tokenizer.chat_template" in metadata:
        ChatTemplate.from_metadata(metadata, source=source).render(SAMPLE_CHAT)


def weight_bytes(files: Mapping[str, Any], dequantised: bool) -> Callable[[Weight], int]:
    """Bytes a weight takes on the device: as stored, or as float32 for the interpreter."""
    def size(w: Weight) -> int:
        info = files[w.source].tensors[w.tensor]
        return info.n_elements * 4 if dequantised else info.n_bytes
    return size


def check_fits(graphs: Mapping[str, Graph], files: Mapping[str, Any], *, n_ctx: int, block_size: int,
               dequantised: bool, where: str, progress: Callable[[str], None] = lambda msg: None) -> MemoryNeed:
    """Say what the pair needs and refuse it when the machine has less (MemoryLimitError)."""
    need = memory_need(graphs, weight_bytes(files, dequantised), n_ctx, block_size)
    progress(f"memory needed: {need.describe()}")
    check_memory(need, where)
    return need


def check_weights(graphs: Mapping[str, Graph], files: Mapping[str, Any], where: str) -> None:
    """Every weight a graph reads exists in its source GGUF with the declared type and shape."""
    for name, graph in graphs.items():
        for w in graph.weights:
            info = files[w.source].tensors.get(w.tensor) if w.source in files else None
            if info is None:
                raise ArtifactError(f"{where}: graph {name} reads tensor {w.tensor!r} of {w.source!r}, which the "
                                    "source GGUFs do not have")
            want = (w.value.type.dtype, storage_shape(w.value.type.concrete({}), w.value.type.dtype))
            if (info.dtype, info.storage_shape) != want:
                raise ArtifactError(f"{where}: graph {name} declares {w.tensor!r} as {w.value.type}, the "
                                    f"{w.source} GGUF holds {info.dtype.value} {list(info.shape)}")
