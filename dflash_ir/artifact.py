"""Artifacts: what `dflash-compile` writes and `load_compiled()` reads back.

    OUT/
      manifest.yaml   format and tool version, backend, source GGUFs (path, size, sha256),
                      model configs, programs (graph file + backend entry), every file's sha256
      graphs/         the IR of every program (YAML), as the backend compiled it
      kernels/        backend files (sources, binaries), when the backend has any

Weights stay in the GGUFs (memory-mapped at load); the manifest pins them by hash.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Callable

import yaml

from . import __version__
from .errors import ArtifactError
from .serialize import YAML_DUMPER, YAML_LOADER, dump_yaml, load_yaml

FORMAT = "dflash-ir.artifact"
FORMAT_VERSION = 2  # 2: target programs output their greedy ids
DEFAULT_CTX = 4096


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _source_entry(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256(path)}


@dataclasses.dataclass
class ModelPair:
    """An opened and validated target (and optional draft) with every graph the runtime runs."""

    files: dict  # role -> GGUFFile
    configs: dict  # role -> config dataclass
    graphs: dict  # program name -> Graph
    extra_taps: tuple[int, ...] = ()

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.configs["draft"].tap_layers) if "draft" in self.configs else self.extra_taps

    def weights(self, w):
        """Weight loader for programs: storage of tensor `w.tensor` in the file of role `w.source`."""
        return self.files[w.source].raw(w.tensor)


def open_pair(target, draft=None, *, taps: tuple[int, ...] = (),
              progress: Callable[[str], None] = lambda msg: None, opt_level: int = 2, dump_dir=None) -> ModelPair:
    """Open and validate the files and build the graphs, optimised at `opt_level` (see
    dflash_ir.passes.pipeline; `dump_dir` gets the IR after each pass). Tap layers come from
    the draft, or from `taps` (HF 0-based layer ids) for a target alone."""
    from dflash_ir.models.checks import check_pair
    from dflash_ir.models.config import DraftConfig, TargetConfig
    from dflash_ir.models.tensors import validate_tensors
    from dflash_ir.models.dflash import DFlashBuilder
    from dflash_ir.models.gguf_file import open_gguf
    from dflash_ir.models.qwen35 import GraphSpec, Qwen35Builder
    from dflash_ir.passes.pipeline import run_pipeline

    progress(f"reading {target}")
    tgt = open_gguf(target)
    tcfg = TargetConfig.from_gguf(tgt)
    validate_tensors(tgt, tcfg)
    pair = ModelPair({"target": tgt}, {"target": tcfg}, {}, tuple(taps))
    if draft is not None:
        progress(f"reading {draft}")
        dft = open_gguf(draft)
        dcfg = DraftConfig.from_gguf(dft)
        validate_tensors(dft, dcfg)
        check_pair(dcfg, tcfg, draft_path=dft.path, target_path=tgt.path)
        pair.files["draft"], pair.configs["draft"] = dft, dcfg
        db = DFlashBuilder(dft, dcfg, tgt, tcfg)
        pair.graphs["draft.inject"] = db.inject()
        pair.graphs["draft.block"] = db.block()
    tb = Qwen35Builder(tgt, tcfg)
    for kind in ("prefill", "verify", "decode"):
        pair.graphs[f"target.{kind}"] = tb.build(GraphSpec(kind, pair.taps, 1 if kind == "decode" else "T"))
    pair.graphs = {name: run_pipeline(g, level=opt_level, dump_dir=dump_dir) for name, g in pair.graphs.items()}
    return pair


def make_engine(programs: dict, *, n_ctx: int, n_max: int, draft_cfg: dict | None, target_meta=None,
                target_source: str = "target", info: dict | None = None):
    """Wire runners around loaded programs (names 'target.*', 'draft.*') into an Engine."""
    from dflash_ir.runtime.draft_runner import DraftRunner
    from dflash_ir.runtime.engine import Engine
    from dflash_ir.runtime.target_runner import TargetRunner

    def role(prefix):
        return {k.split(".", 1)[1]: p for k, p in programs.items() if k.startswith(prefix + ".")}

    target = TargetRunner(role("target"), n_ctx)
    draft = None
    if draft_cfg is not None:
        draft = DraftRunner(role("draft"), n_ctx, block_size=int(draft_cfg["block_size"]),
                            mask_token_id=int(draft_cfg["mask_token_id"]))
    tokenizer = chat = None
    if target_meta is not None:
        from dflash_ir.models.chat_template import ChatTemplate
        from dflash_ir.models.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_metadata(target_meta, source=target_source)
        chat = ChatTemplate.from_metadata(target_meta) if "tokenizer.chat_template" in target_meta else None
    return Engine(target, draft, tokenizer, chat, n_max=n_max, info=info)


def open_engine(target, draft=None, *, n_ctx: int = DEFAULT_CTX, n_max: int = 15, load_tokenizer: bool = False,
                taps: tuple[int, ...] = (), opt_level: int = 0):
    """An Engine on the reference interpreter straight from GGUF files, without an artifact."""
    from dflash_ir.interpreter import Interpreter

    pair = open_pair(target, draft, taps=taps, opt_level=opt_level)
    programs = {name: Interpreter(g, pair.weights) for name, g in pair.graphs.items()}
    draft_cfg = dataclasses.asdict(pair.configs["draft"]) if "draft" in pair.configs else None
    meta = pair.files["target"].metadata if load_tokenizer else None
    return make_engine(programs, n_ctx=n_ctx, n_max=n_max, draft_cfg=draft_cfg, target_meta=meta,
                       target_source=str(pair.files["target"].path))


def compile_pair(target, draft=None, *, out, backend: str = "numpy", n_ctx: int = DEFAULT_CTX, n_max: int = 15,
                 progress: Callable[[str], None] = lambda msg: None, opt_level: int | None = None,
                 dump_dir=None) -> Path:
    """Validate the pair, build its graphs, compile them with `backend` and write the artifact.
    `opt_level` None takes the backend's default."""
    from dflash_ir.backends.base import get_backend

    out = Path(out)
    be = get_backend(backend)
    opt_level = be.default_opt_level if opt_level is None else opt_level
    pair = open_pair(target, draft, progress=progress, opt_level=opt_level, dump_dir=dump_dir)
    if "draft" in pair.configs and not 1 <= n_max < pair.configs["draft"].block_size:
        raise ValueError(f"n_max must be in 1..{pair.configs['draft'].block_size - 1} for block size "
                         f"{pair.configs['draft'].block_size}, got {n_max}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "graphs").mkdir(exist_ok=True)
    programs = {}
    for i, (name, graph) in enumerate(pair.graphs.items(), 1):
        progress(f"[{i}/{len(pair.graphs)}] compiling {name} ({len(graph.nodes)} nodes) for {backend}")
        rel = f"graphs/{name}.yaml"
        (out / rel).write_text(dump_yaml(graph))
        programs[name] = {"graph": rel, "backend": be.compile(graph, out)}
    progress("hashing sources")
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dflash_ir_version": __version__,
        "backend": {"name": backend, "device": be.device_description()},
        "sources": {role: _source_entry(Path(f.path)) for role, f in pair.files.items()},
        "config": {**{role: dataclasses.asdict(c) for role, c in pair.configs.items()},
                   "n_ctx": n_ctx, "n_max": n_max, "taps": list(pair.taps), "opt_level": opt_level},
        "programs": programs,
    }
    manifest["files"] = {str(p.relative_to(out)): _sha256(p) for p in sorted(out.rglob("*"))
                         if p.is_file() and p.name != "manifest.yaml"}
    (out / "manifest.yaml").write_text(yaml.dump(manifest, Dumper=YAML_DUMPER, sort_keys=False))
    progress(f"wrote {out}")
    return out


def read_manifest(path) -> dict:
    path = Path(path)
    mf = path / "manifest.yaml"
    if not mf.is_file():
        raise ArtifactError(f"{path}: no manifest.yaml: not a dflash-ir artifact (make one with dflash-compile)")
    try:
        manifest = yaml.load(mf.read_text(), Loader=YAML_LOADER)
    except yaml.YAMLError as e:
        raise ArtifactError(f"{mf}: not valid YAML ({e}): the artifact is damaged; recompile it") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{mf}: not a dflash-ir artifact manifest")
    made_by = (manifest.get("format_version"), manifest.get("dflash_ir_version"))
    if made_by != (FORMAT_VERSION, __version__):
        raise ArtifactError(f"{path}: made by dflash-ir {made_by[1]} (artifact format {made_by[0]}); this is dflash-ir "
                            f"{__version__} (format {FORMAT_VERSION}): recompile with dflash-compile")
    for rel, digest in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            raise ArtifactError(f"{path}: file {rel} listed in the manifest is missing; recompile the artifact")
        if _sha256(f) != digest:
            raise ArtifactError(f"{path}: file {rel} was modified after compilation (sha256 mismatch); recompile the artifact")
    return manifest


def _check_source(role: str, entry: dict) -> Path:
    p = Path(entry["path"])
    if not p.is_file():
        raise ArtifactError(f"the {role} GGUF {p} the artifact was compiled from is missing")
    st = p.stat()
    if st.st_size != entry["size"]:
        raise ArtifactError(f"the {role} GGUF {p} changed since compilation (size {st.st_size} != {entry['size']}); recompile")
    if st.st_mtime_ns != entry["mtime_ns"] and _sha256(p) != entry["sha256"]:
        raise ArtifactError(f"the {role} GGUF {p} changed since compilation (sha256 mismatch); recompile")
    return p


def load_compiled(path, *, load_tokenizer: bool = True, n_max: int | None = None, measure_costs: bool = True):
    """Verify an artifact and return a ready Engine; with a draft and `measure_costs`, the
    engine knows its round costs on this device (runtime/costs.py: measured once, cached)."""
    from dflash_ir.backends.base import get_backend
    from dflash_ir.models.gguf_file import open_gguf

    path = Path(path)
    manifest = read_manifest(path)
    be = get_backend(manifest["backend"]["name"])
    be.require()
    files = {role: open_gguf(_check_source(role, entry)) for role, entry in manifest["sources"].items()}

    def weights(w):
        return files[w.source].raw(w.tensor)

    programs = {name: be.load(load_yaml((path / entry["graph"]).read_text()), entry["backend"], path, weights)
                for name, entry in manifest["programs"].items()}
    cfg = manifest["config"]
    engine = make_engine(programs, n_ctx=int(cfg["n_ctx"]), n_max=n_max or int(cfg["n_max"]), draft_cfg=cfg.get("draft"),
                         target_meta=files["target"].metadata if load_tokenizer else None,
                         target_source=str(files["target"].path),
                         info={"artifact": str(path), "backend": manifest["backend"], "sources": manifest["sources"]})
    if measure_costs and engine.draft is not None:
        from dflash_ir.runtime.costs import artifact_costs

        engine.costs = artifact_costs(engine, (path / "manifest.yaml").read_text(), be)
    return engine
