"""Helpers of the malformed-input suite: tiny GGUFs edited through the generator's plans,
and a manifest rewritten the way someone tampering with care would (hashes and digest
recomputed)."""
from __future__ import annotations

import re

import yaml

from dflash_ir.integrity import MANIFEST, sha256_file, with_digest
from dflash_ir.models.generator import draft_plan, target_plan, tiny_draft_config, tiny_target_config, write_gguf

TARGET_CFG = tiny_target_config("qwen35")
DRAFT_CFG = tiny_draft_config(TARGET_CFG)


def target_file(path, edit=lambda plan: None, dtype="q8_0"):
    """A tiny target GGUF whose plan `edit` changed first."""
    plan = target_plan(TARGET_CFG, dtype=dtype, seed=1)
    edit(plan)
    return write_gguf(path, plan)


def draft_file(path, edit=lambda plan: None):
    plan = draft_plan(DRAFT_CFG, target_cfg=TARGET_CFG, dtype="f16", seed=2)
    edit(plan)
    return write_gguf(path, plan)


def set_key(key, value):
    return lambda plan: plan.metadata.__setitem__(key, value)


def manifest_of(folder) -> dict:
    return yaml.safe_load((folder / MANIFEST).read_text())


def rewrite(folder, edit) -> str:
    """Edit the manifest as a dict and write it back with the hashes of its listed files and
    its digest line recomputed; the new root digest."""
    manifest = manifest_of(folder)
    manifest.pop("digest")
    edit(manifest)
    if isinstance(manifest.get("files"), dict):
        manifest["files"] = {rel: sha256_file(folder / rel) if (folder / rel).is_file() else digest
                             for rel, digest in manifest["files"].items()}
    text, digest = with_digest(yaml.safe_dump(manifest, sort_keys=False))
    (folder / MANIFEST).write_text(text)
    return digest


def names(path) -> str:
    """A regex matching `path` as it appears in a message."""
    return re.escape(str(path))
