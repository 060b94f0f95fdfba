"""Where dflash-ir keeps what it makes once and reuses: `<cache home>/dflash-ir/<what>`, the
cache home being `$XDG_CACHE_HOME` or `~/.cache`. Folders: `bench/` (dflash-bench's generated
pairs), `demo/` (`make demo`'s compiled pair), `serve/` (dflash-serve's compiled artifacts),
`kernels/` (device compilers' output), `costs/` (measured round costs). Deleting any of them
is safe: it is made again."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(what: str, env: str | None = None) -> Path:
    """The folder for `what`; `$<env>` instead where that variable is set."""
    if env and (override := os.environ.get(env)):
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-ir" / what
