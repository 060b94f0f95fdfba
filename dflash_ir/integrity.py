"""The integrity model of artifacts: what `load_compiled` trusts, and why.

- The manifest ends with `digest: <sha256 of every byte above that line>`: the artifact's
  root digest, printed by dflash-compile. A manifest edited without recomputing it is
  refused; `load_compiled(digest=...)` / `dflash-run --artifact-digest` pin it, so an
  edit that did recompute it is refused too.
- The manifest lists every other file of the artifact with its sha256 (`files`). Before
  any program is loaded each listed path is checked to be relative, inside the artifact
  folder once symlinks are resolved, and a regular file, and its bytes are hashed; graphs
  are parsed from exactly the bytes that were hashed, backends read kernels through
  `artifact_file`, which only hands out listed paths.
- The manifest and the graphs are read with strict_yaml (no aliases, bounded depth), and
  the manifest's fields are checked for presence and type (`manifest_schema`).
- Source GGUFs are pinned by size and sha256. `strict` hashes them at every load (about
  13 s per 10 GB at the ~0.8 GB/s sha256 of this project's 2-core CI machine, more when
  the file is not in the page cache); `fast` (the default) hashes them only when their
  stat fingerprint (size, mtime, ctime, inode, device) changed since compilation. A
  change to a file's bytes through the file system sets its ctime to the present, which
  no user call can set back, so fast still catches a modification whose mtime was restored.

Hashes catch corruption and edits; they do not stop someone who rewrites the manifest and
its digest together, unless the digest is pinned. A launch plan that would send a kernel
past its buffers is refused at load by the runner's plan check (backends/launch_check.py:
each launch against its kernel's contract and the memory plan; a contract rewritten with
its launches gets through, a pinned digest does not), and Vulkan's checked mode keeps such
a kernel inside its buffers.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from .errors import ArtifactError
from .hashing import sha256_file
from .models.gguf_file import file_kind

MANIFEST = "manifest.yaml"
SOURCE_CHECKS = ("fast", "strict")
MAX_MANIFEST_BYTES = 64 << 20
_DIGEST_LINE = re.compile(rb"digest: ([0-9a-f]{64})\n\Z")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def with_digest(body: str) -> tuple[str, str]:
    """(manifest text, root digest): the body with its digest line appended."""
    if not body.endswith("\n"):
        body += "\n"
    digest = sha256_bytes(body.encode())
    return f"{body}digest: {digest}\n", digest


def read_regular(path: Path, what: str, limit: int | None = None) -> bytes:
    """The bytes of a regular file (a named pipe, a device or a directory is refused before
    it is read), at most `limit` of them."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ArtifactError(f"{what} {path} is missing") from None
    except OSError as e:
        raise ArtifactError(f"{what} {path} cannot be opened: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{what} {path} is {file_kind(st.st_mode)}, not a regular file")
        if limit is not None and st.st_size > limit:
            raise ArtifactError(f"{what} {path} has {st.st_size} bytes, more than the {limit} allowed")
        return f.read()


def manifest_bytes(folder: Path) -> bytes:
    """The manifest file's bytes (a regular file of at most MAX_MANIFEST_BYTES)."""
    path = folder / MANIFEST
    if not path.exists():
        raise ArtifactError(f"{folder}: no {MANIFEST}: not a dflash-ir artifact (make one with dflash-compile)")
    return read_regular(path, "the artifact manifest", MAX_MANIFEST_BYTES)


def check_digest(folder: Path, data: bytes, pinned: str | None = None) -> str:
    """The root digest of manifest bytes `data`, once its digest line matches the bytes
    above it (and `pinned`, when given)."""
    path = folder / MANIFEST
    body_end = data.rfind(b"\n", 0, len(data) - 1) + 1
    match = _DIGEST_LINE.match(data, body_end)
    if match is None:
        raise ArtifactError(f"{path}: the last line is not 'digest: <sha256>': the manifest is damaged or was "
                            "written by hand; recompile the artifact")
    found = match[1].decode()
    if sha256_bytes(data[:body_end]) != found:
        raise ArtifactError(f"{path} was modified after compilation (its digest does not match); recompile the artifact")
    if pinned is not None and pinned != found:
        raise ArtifactError(f"{folder}: the artifact's digest is {found}, not the pinned {pinned}")
    return found


def confined(folder: Path, rel: str, what: str) -> Path:
    """`folder/rel` for a relative path that stays inside the folder once symlinks are resolved."""
    parts = Path(rel).parts
    if not rel or Path(rel).is_absolute() or ".." in parts:
        raise ArtifactError(f"{folder}: {what} path {rel!r} leaves the artifact folder")
    path = folder / rel
    root = folder.resolve()
    if not path.resolve().is_relative_to(root):
        raise ArtifactError(f"{folder}: {what} path {rel!r} resolves to {path.resolve()}, outside the artifact folder")
    return path


def verified_files(folder: Path, files: Mapping[str, str]) -> dict[str, bytes]:
    """Every listed file's bytes, each confined to the folder, regular and matching its sha256."""
    contents = {}
    for rel, digest in files.items():
        data = read_regular(confined(folder, rel, "listed file"), f"{folder}: file {rel} listed in the manifest:")
        if sha256_bytes(data) != digest:
            raise ArtifactError(f"{folder}: file {rel} was modified after compilation (sha256 mismatch); "
                                "recompile the artifact")
        contents[rel] = data
    return contents


def check_entry_paths(entry: Any, where: str, field: str = "backend") -> None:
    """Refuse a backend entry holding a string that, read as a path, leaves the artifact
    folder (absolute, or with a '..' part): whatever backend joins it to the folder later."""
    if isinstance(entry, dict):
        for key, value in entry.items():
            check_entry_paths(value, where, f"{field}.{key}")
    elif isinstance(entry, list):
        for i, value in enumerate(entry):
            check_entry_paths(value, where, f"{field}[{i}]")
    elif isinstance(entry, str) and (entry.startswith("/") or ".." in PurePosixPath(entry).parts):
        raise ArtifactError(f"{where}: {field} = {entry!r} is a path leaving the artifact folder")


def artifact_file(folder: Path, rel: str) -> Path:
    """The path of file `rel` of a loaded artifact, for backends reading their kernels: only
    a confined, regular file (its hash was checked with the others before loading)."""
    path = confined(Path(folder), rel, "kernel")
    if not path.is_file():
        raise ArtifactError(f"{folder}: kernel file {rel} is missing or not a regular file")
    return path


def source_entry(path: Path) -> dict[str, Any]:
    """What the manifest pins of a source GGUF."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, **_fingerprint(st), "sha256": sha256_file(path)}


def _fingerprint(st: os.stat_result) -> dict[str, int]:
    return {"mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "device": st.st_dev}


def check_source(role: str, entry: Mapping[str, Any], mode: str) -> Path:
    """The source GGUF's path once it is what compilation saw: `strict` hashes it, `fast`
    hashes it only when its stat fingerprint changed (see the module docstring)."""
    if mode not in SOURCE_CHECKS:
        raise ValueError(f"source check must be one of {', '.join(SOURCE_CHECKS)}, not {mode!r}")
    path = Path(entry["path"])
    try:
        st = path.stat()
    except OSError:
        raise ArtifactError(f"the {role} GGUF {path} the artifact was compiled from is missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(f"the {role} GGUF {path} is {file_kind(st.st_mode)}, not a regular file")
    if st.st_size != entry["size"]:
        raise ArtifactError(f"the {role} GGUF {path} changed since compilation "
                            f"(size {st.st_size} != {entry['size']}); recompile")
    unchanged = all(entry.get(k) == v for k, v in _fingerprint(st).items())
    if (mode == "strict" or not unchanged) and sha256_file(path) != entry["sha256"]:
        raise ArtifactError(f"the {role} GGUF {path} changed since compilation (sha256 mismatch); recompile")
    return path
