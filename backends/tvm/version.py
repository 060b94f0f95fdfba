"""The TVM the backend is built for, and the pin an artifact carries: a kernel library built
by one TVM must be loaded by the same one (the runtime ABI and codegen change between
releases), so a mismatch is refused by name rather than left to crash."""
from __future__ import annotations

from typing import Mapping

from dflash_ir.errors import ArtifactError

PINNED = "0.27.0.post1"
INSTALL = f"pip install apache-tvm=={PINNED}"


def installed() -> str | None:
    """The installed apache-tvm version, None when it cannot be imported."""
    try:
        import tvm
    except ImportError:
        return None
    return tvm.__version__


def unavailable_reason() -> str | None:
    version = installed()
    if version is None:
        return f"apache-tvm is not installed ({INSTALL})"
    if version != PINNED:
        return f"apache-tvm {version} is installed but this backend is built for {PINNED} ({INSTALL})"
    return None


def check_artifact(entry: Mapping) -> None:
    """Raise ArtifactError when the installed TVM is not the one that built `entry`."""
    built = entry["tvm"]["version"]
    have = installed()
    if have != built:
        found = f"apache-tvm {have} is installed" if have else "apache-tvm is not installed"
        raise ArtifactError(f"this artifact's kernels were built by apache-tvm {built} and need it to load, but "
                            f"{found}: pip install apache-tvm=={built}, or recompile the artifact")
