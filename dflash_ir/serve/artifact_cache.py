"""`dflash-serve -m TARGET.gguf -md DRAFT.gguf`: compile the pair on first start into a cache
folder and load it from there on every later start.

The folder is named by what the artifact depends on (the GGUFs' absolute paths, sizes and
modification times, backend, context size, optimisation level, numerics, dflash-ir version), so a
changed input compiles afresh; a cached artifact that fails `load_compiled`'s checks is
compiled again. A compile writes to a temporary folder renamed into place when complete,
so an interrupted one leaves nothing that looks finished.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from dflash_ir import __version__
from dflash_ir.cache import cache_dir
from dflash_ir.errors import ArtifactError


def default_cache_dir() -> Path:
    return cache_dir("serve")


def cache_folder(cache_dir: Path, target: Path, draft: Path | None, *, backend: str, n_ctx: int,
                 opt_level: int | None, numerics: str) -> Path:
    def source(p: Path | None):
        if p is None:
            return None
        st = p.stat()
        return [str(p.resolve()), st.st_size, st.st_mtime_ns]

    key = json.dumps([source(target), source(draft), backend, n_ctx, opt_level, numerics, __version__])
    return Path(cache_dir) / f"{target.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def cached_artifact(target: Path, draft: Path | None, *, cache_dir: Path, backend: str, n_ctx: int,
                    n_max: int | None, opt_level: int | None, numerics: str | None, dump_dir=None,
                    progress: Callable[[str], None], check: Callable[[Path], None]) -> Path:
    """The folder of the pair's cached artifact, compiled first when there is none or when
    `check` (raises ArtifactError) refuses the one there. `numerics` None: the backend's default."""
    from dflash_ir.artifact import compile_pair, resolve_numerics

    numerics = resolve_numerics(backend, numerics)
    folder = cache_folder(cache_dir, target, draft, backend=backend, n_ctx=n_ctx, opt_level=opt_level,
                          numerics=numerics)
    if folder.is_dir():
        try:
            check(folder)
            progress(f"reusing the compiled artifact {folder}")
            return folder
        except ArtifactError as e:
            progress(f"the cached artifact {folder} cannot be used ({e}); compiling again")
            shutil.rmtree(folder)
    progress(f"compiling {target.name}{' + ' + draft.name if draft else ''} for {backend} into {folder}")
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    compile_pair(target.resolve(), draft.resolve() if draft else None, out=partial, backend=backend, n_ctx=n_ctx,
                 n_max=n_max, opt_level=opt_level, numerics=numerics, dump_dir=dump_dir, progress=progress)
    partial.rename(folder)
    return folder


def load_or_compile(target: Path, draft: Path | None, *, n_max: int | None, **where):
    """The Engine of the pair's cached artifact (`cached_artifact`'s arguments), compiling it
    first when there is none; a cached one is checked by loading it."""
    from dflash_ir.artifact import load_compiled

    loaded = []
    folder = cached_artifact(target, draft, n_max=n_max, check=lambda f: loaded.append(load_compiled(f, n_max=n_max)),
                             **where)
    return loaded[0] if loaded else load_compiled(folder, n_max=n_max)
