"""dflash-ir: DFlash speculative decoding as a compiler (GGUF pair -> IR -> passes -> device artifacts)."""

__version__ = "0.1.0"


def load_compiled(path, **kwargs):
    """Load an artifact written by `dflash-compile` and return its Engine (see dflash_ir.artifact)."""
    from .artifact import load_compiled as _load

    return _load(path, **kwargs)


def compile_pair(target, draft=None, **kwargs):
    """Compile a target GGUF (and optionally a DFlash draft GGUF) into an artifact folder."""
    from .artifact import compile_pair as _compile

    return _compile(target, draft, **kwargs)
