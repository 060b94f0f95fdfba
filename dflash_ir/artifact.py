"""Artifacts: what `dflash-compile` writes and `load_compiled()` reads back.

    OUT/
      manifest.yaml   format and tool version, backend, source GGUFs (path, size, sha256),
                      model configs, programs (graph file + backend entry), every file's
                      sha256, and last its own digest (the artifact's root digest)
      graphs/         the IR of every program (YAML), as the backend compiled it
      kernels/        backend files (sources, binaries), when the backend has any

Weights stay in the GGUFs (memory-mapped at load); the manifest pins them by hash. What a
load checks before anything runs is dflash_ir/integrity.py's model; the limits checked
before anything is allocated are models/checks.py's and dflash_ir/memory.py's.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from . import __version__, strict_yaml
from .errors import ArtifactError
from .integrity import (MANIFEST, check_digest, check_entry_paths, check_source, manifest_bytes, sha256_file,
                        source_entry, verified_files, with_digest)
from .manifest_schema import check_manifest
from .pair_checks import check_fits, check_text_processing, check_weights, resolve_lengths
from .serialize import YAML_DUMPER, GraphFormatError, dump_yaml, load_yaml

FORMAT = "dflash-ir.artifact"
FORMAT_VERSION = 7  # 2: target programs output their greedy ids; 3: the manifest's digest line;
#                     4: launch plans carry their memory plan (slots, buffers); 5: and kernel contracts;
#                     6: batched verify programs (VERIFY_SLOTS) with a draft; 7: a commit program replays
#                     the recurrent layers over the accepted rows (no per-row states)
TARGET_PROGRAMS = ("prefill", "verify", "decode")
COMMIT = "commit"  # the target's program for its recurrent layers' rollback, where it has such layers
# sequences whose blocks one batched verify takes (`target.verify_s<S>`, block-size rows each):
# dflash-serve verifies its busy slots' blocks together in passes of these sizes
VERIFY_SLOTS = (2, 4)
DRAFT_PROGRAMS = ("inject", "block")
DEFAULT_CTX = 4096
DEFAULT_N_MAX = 15


@dataclasses.dataclass
class ModelPair:
    """An opened and validated target (and optional draft) with every graph the runtime runs."""

    files: dict  # role -> GGUFFile
    configs: dict  # role -> config dataclass
    graphs: dict  # program name -> Graph
    extra_taps: tuple[int, ...] = ()
    draft_vocab: Any = None  # a reduced draft head's d2t ids (models/draft_vocab.py), read once

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.configs["draft"].tap_layers) if "draft" in self.configs else self.extra_taps

    def __post_init__(self):
        self.weights = FileWeights(self.files)


MIB = 1 << 20


class FileWeights:
    """Weight loader for programs (dflash_ir/program.py): storage of tensor `w.tensor` in the
    file of role `w.source`, a view of the mapped GGUF; `release` drops a part a backend has
    copied to its device from this process's memory. Given the graphs a load reads weights
    for, it tells `progress` how far the load is at every tenth of their bytes (a large
    model's weights are what takes a load its time)."""

    def __init__(self, files: dict, *, graphs: Mapping[str, Any] = {},
                 progress: Callable[[str], None] = lambda msg: None):
        self.files = files  # role -> GGUFFile
        self.progress = progress
        self._sizes = {(w.source, w.tensor): files[w.source].tensors[w.tensor].n_bytes
                       for g in graphs.values() for w in g.weights}
        self._read: set[tuple[str, str]] = set()
        self._done = self._tenths = 0

    def __call__(self, w):
        key = (w.source, w.tensor)
        if key in self._sizes and key not in self._read:
            self._read.add(key)
            self._done += self._sizes[key]
            total = sum(self._sizes.values())
            if self._done * 10 // total > self._tenths:
                self._tenths = self._done * 10 // total
                self.progress(f"weights {self._done * 100 // total}%: {self._done / MIB:.1f} of {total / MIB:.1f} "
                              f"MiB, {len(self._read)} of {len(self._sizes)} tensors")
        return self.files[w.source].raw(w.tensor)

    def release(self, w, part) -> None:
        self.files[w.source].release(part)


def batched_verify(slots: int) -> str:
    """The target program that verifies the blocks of `slots` sequences in one pass."""
    return f"verify_s{slots}"


def open_pair(target, draft=None, *, taps: tuple[int, ...] = (),
              progress: Callable[[str], None] = lambda msg: None, opt_level: int = 2, dump_dir=None,
              numerics: str = "exact") -> ModelPair:
    """Open and validate the files and build the graphs, optimised at `opt_level` (see
    dflash_ir.passes.pipeline; `dump_dir` gets the IR after each pass). Tap layers come from
    the draft, or from `taps` (HF 0-based layer ids) for a target alone."""
    from dflash_ir.models.checks import check_pair
    from dflash_ir.models.config import DraftConfig, TargetConfig
    from dflash_ir.models.tensors import validate_tensors
    from dflash_ir.models.dflash import DFlashBuilder
    from dflash_ir.models.draft_vocab import read_d2t
    from dflash_ir.models.gguf_file import open_gguf
    from dflash_ir.models.targets import target_builder
    from dflash_ir.models.transformer import GraphSpec
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
        if dcfg.draft_vocab:
            pair.draft_vocab = read_d2t(dft, tcfg.vocab_size)
            progress(f"the draft's own head: {dcfg.draft_vocab} of the target's {tcfg.vocab_size} tokens (d2t)")
        pair.files["draft"], pair.configs["draft"] = dft, dcfg
        db = DFlashBuilder(dft, dcfg, tgt, tcfg)
        pair.graphs["draft.inject"] = db.inject()
        pair.graphs["draft.block"] = db.block()
    tb = target_builder(tgt, tcfg)
    for kind in TARGET_PROGRAMS:
        pair.graphs[f"target.{kind}"] = tb.build(GraphSpec(kind, pair.taps, 1 if kind == "decode" else "T"))
    commit = tb.commit()
    if commit is not None:
        pair.graphs[f"target.{COMMIT}"] = commit
    if draft is not None:
        for slots in VERIFY_SLOTS:
            pair.graphs[f"target.{batched_verify(slots)}"] = tb.build(
                GraphSpec("verify", pair.taps, pair.configs["draft"].block_size, slots=slots))
    pair.graphs = {name: run_pipeline(g, level=opt_level, dump_dir=dump_dir, numerics=numerics)
                   for name, g in pair.graphs.items()}
    return pair


def make_engine(programs: dict, *, n_ctx: int, n_max: int, draft_cfg: dict | None, target_meta=None,
                target_source: str = "target", info: dict | None = None, draft_vocab=None):
    """Wire runners around loaded programs (names 'target.*', 'draft.*') into an Engine;
    `draft_vocab` is a reduced draft head's d2t ids (models/draft_vocab.py)."""
    from dflash_ir.runtime.draft_runner import DraftRunner
    from dflash_ir.runtime.engine import Engine
    from dflash_ir.runtime.target_runner import TargetRunner

    def role(prefix):
        return {k.split(".", 1)[1]: p for k, p in programs.items() if k.startswith(prefix + ".")}

    target = TargetRunner(role("target"), n_ctx)
    draft = None
    if draft_cfg is not None:
        draft = DraftRunner(role("draft"), n_ctx, block_size=int(draft_cfg["block_size"]),
                            mask_token_id=int(draft_cfg["mask_token_id"]), vocab=draft_vocab)
    tokenizer = chat = None
    if target_meta is not None:
        from dflash_ir.models.chat_template import ChatTemplate
        from dflash_ir.models.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_metadata(target_meta, source=target_source)
        chat = ChatTemplate.from_metadata(target_meta) if "tokenizer.chat_template" in target_meta else None
    return Engine(target, draft, tokenizer, chat, n_max=n_max, info=info)


def open_engine(target, draft=None, *, n_ctx: int = DEFAULT_CTX, n_max: int = 15, load_tokenizer: bool = False,
                taps: tuple[int, ...] = (), opt_level: int = 0, numerics: str = "exact"):
    """An Engine on the reference interpreter straight from GGUF files, without an artifact
    (the memory the context needs is checked as for compiling)."""
    from dflash_ir.interpreter import Interpreter

    pair = open_pair(target, draft, taps=taps, opt_level=opt_level, numerics=numerics)
    check_fits(pair.graphs, pair.files, n_ctx=n_ctx, block_size=_block_size(pair.configs.get("draft")),
               dequantised=True, where=f"{pair.files['target'].path} with a context of {n_ctx}")
    programs = {name: Interpreter(g, pair.weights) for name, g in pair.graphs.items()}
    configs = {role: dataclasses.asdict(c) for role, c in pair.configs.items()}
    meta = pair.files["target"].metadata if load_tokenizer else None
    return make_engine(programs, n_ctx=n_ctx, n_max=n_max, draft_cfg=configs.get("draft"), target_meta=meta,
                       target_source=str(pair.files["target"].path), draft_vocab=pair.draft_vocab)


def _draft_vocab(files: Mapping[str, Any], configs: Mapping[str, Mapping[str, Any]]):
    """The d2t ids of a draft with a reduced head, else None."""
    from dflash_ir.models.draft_vocab import read_d2t

    if not configs.get("draft", {}).get("draft_vocab"):
        return None
    return read_d2t(files["draft"], configs["target"]["vocab_size"])


def resolve_numerics(backend: str, numerics: str | None) -> str:
    """`numerics`, or where None the backend's default mode (Backend.default_numerics)."""
    from dflash_ir.backends.base import get_backend

    return numerics or get_backend(backend).default_numerics()


def compile_pair(target, draft=None, *, out, backend: str = "numpy", n_ctx: int = DEFAULT_CTX, n_max: int | None = None,
                 progress: Callable[[str], None] = lambda msg: None, opt_level: int | None = None,
                 numerics: str | None = None, taps: tuple[int, ...] = (),
                 dump_dir=None, tune_s: float | None = None) -> Path:
    """Validate the pair, build its graphs, compile them with `backend` and write the artifact.
    `opt_level` None takes the backend's default; `n_ctx` 0 the target's trained context;
    `numerics` None the backend's default (Backend.default_numerics);
    `n_max` None DEFAULT_N_MAX (block size - 1 when smaller), 0 drafts nothing by default; `taps`
    (HF 0-based layers) makes a target alone output their features. The tokenizer and chat template are built, and the
    memory the context needs is checked, before anything is written."""
    from dflash_ir.backends.base import get_backend

    out = Path(out)
    be = get_backend(backend)
    if tune_s is not None:  # `tune_s` seconds of MetaSchedule: it measures through TVM's runtime, here llvm's
        if be.name != "tvm-llvm":
            raise ValueError(f"--tune: backend {backend} does not tune; tvm-llvm does (backends/tvm/tune.py)")
        be.tune_s, be.progress = tune_s, progress
    opt_level = be.default_opt_level if opt_level is None else opt_level
    numerics = resolve_numerics(backend, numerics)
    pair = open_pair(target, draft, taps=taps, progress=progress, opt_level=opt_level, dump_dir=dump_dir,
                     numerics=numerics)
    n_ctx, n_max = resolve_lengths(pair.configs, n_ctx, n_max, DEFAULT_N_MAX)
    target_file = pair.files["target"]
    check_text_processing(target_file.metadata, str(target_file.path))
    check_fits(pair.graphs, pair.files, n_ctx=n_ctx, block_size=_block_size(pair.configs.get("draft")),
               dequantised=be.name == "numpy", where=f"{target_file.path} with a context of {n_ctx}", progress=progress)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graphs").mkdir(exist_ok=True)
    programs = {}
    for i, (name, graph) in enumerate(pair.graphs.items(), 1):
        progress(f"[{i}/{len(pair.graphs)}] compiling {name} ({len(graph.nodes)} nodes) for {backend}, {numerics} numerics")
        rel = f"graphs/{name}.yaml"
        (out / rel).write_text(dump_yaml(graph))
        programs[name] = {"graph": rel, "backend": be.compile(graph, out)}
    progress(f"hashing the source GGUFs ({sum(f.size_bytes for f in pair.files.values()) / MIB:.0f} MiB)")
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dflash_ir_version": __version__,
        "backend": {"name": backend, "device": be.device_description()},
        "sources": {role: source_entry(Path(f.path)) for role, f in pair.files.items()},
        "config": {**{role: dataclasses.asdict(c) for role, c in pair.configs.items()},
                   "n_ctx": n_ctx, "n_max": n_max, "taps": list(pair.taps), "opt_level": opt_level,
                   "numerics": numerics},
        "programs": programs,
    }
    manifest["files"] = {str(p.relative_to(out)): sha256_file(p) for p in sorted(out.rglob("*"))
                         if p.is_file() and p.name != MANIFEST}
    text, digest = with_digest(yaml.dump(manifest, Dumper=YAML_DUMPER, sort_keys=False))
    (out / MANIFEST).write_text(text)
    progress(f"wrote {out} (digest {digest})")
    return out


def read_manifest(path, *, digest: str | None = None) -> dict:
    """The manifest of artifact `path` once its digest (and the pinned `digest`), its YAML,
    its version and the fields the loader reads are checked."""
    path = Path(path)
    data, where = manifest_bytes(path), str(path / MANIFEST)
    try:  # strict YAML is safe on any bytes: the version is told before the digest is judged
        manifest = strict_yaml.load(data.decode("utf-8"), where)
    except (UnicodeDecodeError, strict_yaml.StrictYAMLError) as e:
        raise ArtifactError(f"{where}: not a valid manifest ({e}): the artifact is damaged; recompile it") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{where}: not a dflash-ir artifact manifest")
    made_by = (manifest.get("format_version"), manifest.get("dflash_ir_version"))
    if made_by != (FORMAT_VERSION, __version__):
        raise ArtifactError(f"{path}: made by dflash-ir {made_by[1]} (artifact format {made_by[0]}); this is dflash-ir "
                            f"{__version__} (format {FORMAT_VERSION}): recompile with dflash-compile")
    check_digest(path, data, digest)
    check_manifest(manifest, where)
    config = manifest["config"]
    if "draft" in config and config["n_max"] >= config["draft"]["block_size"]:
        raise ArtifactError(f"{where}: config.n_max = {config['n_max']} is not below the draft's block size "
                            f"{config['draft']['block_size']}")
    return manifest


def _load_program(be, name: str, graph, entry: dict, path: Path, weights):
    """`be.load`, with a backend entry lacking a field or holding one of the wrong type (the
    manifest's schema leaves backend entries to their backends) named as such."""
    try:
        return be.load(graph, entry, path, weights)
    except (KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(f"{path / MANIFEST}: programs.{name}.backend is malformed for backend {be.name!r} "
                            f"({type(e).__name__}: {e}); recompile the artifact") from None


def _block_size(draft) -> int:
    """The draft's block size from its config or its manifest entry; 1 without a draft."""
    if draft is None:
        return 1
    return draft["block_size"] if isinstance(draft, dict) else draft.block_size


def load_graphs(path: Path, manifest: dict) -> dict:
    """Every program's graph, parsed from the bytes whose sha256 was checked and verified;
    the programs must be exactly those of the manifest's config."""
    from .verifier import VerifyError, verify

    contents = verified_files(path, manifest["files"])
    drafted = "draft" in manifest["config"]
    recurrent = any(manifest["config"]["target"]["layer_is_recurrent"])
    wanted = ({f"target.{k}" for k in TARGET_PROGRAMS + ((COMMIT,) if recurrent else ())} |
              ({f"draft.{k}" for k in DRAFT_PROGRAMS} | {f"target.{batched_verify(s)}" for s in VERIFY_SLOTS}
               if drafted else set()))
    if set(manifest["programs"]) != wanted:
        raise ArtifactError(f"{path}: the manifest's programs are {sorted(manifest['programs'])}, "
                            f"expected {sorted(wanted)}; recompile the artifact")
    graphs = {}
    for name, entry in manifest["programs"].items():
        check_entry_paths(entry["backend"], str(path / MANIFEST), f"programs.{name}.backend")
        rel = entry["graph"]
        if rel not in contents:
            raise ArtifactError(f"{path}: the graph {rel} of program {name} is not among the manifest's files")
        where = f"{path / rel}"
        try:
            graphs[name] = verify(load_yaml(contents[rel].decode("utf-8"), where))
        except (UnicodeDecodeError, strict_yaml.StrictYAMLError, GraphFormatError, VerifyError) as e:
            raise ArtifactError(f"{where}: not a valid graph: {e}") from None
    return graphs


def load_compiled(path, *, load_tokenizer: bool = True, n_max: int | None = None, measure_costs: bool = True,
                  digest: str | None = None, sources: str = "fast", progress: Callable[[str], None] = lambda msg: None):
    """Verify an artifact and return a ready Engine; with a draft and `measure_costs`, the
    engine knows its round costs on this device (runtime/costs.py: measured once, cached) and
    starts from the acceptance its draft showed in the last process that used the artifact.
    `digest` pins the artifact's root digest; `sources` is how the source GGUFs are checked,
    "fast" or "strict" (dflash_ir/integrity.py); `progress` gets a line per stage, the
    memory needed before anything is allocated, and the weights' upload every tenth."""
    from dflash_ir.backends.base import get_backend
    from dflash_ir.models.gguf_file import open_gguf

    path = Path(path)
    progress(f"checking {path}")
    manifest = read_manifest(path, digest=digest)
    graphs = load_graphs(path, manifest)
    be = get_backend(manifest["backend"]["name"])
    be.require()
    progress(f"checking the source GGUFs ({sources})")
    files = {role: open_gguf(check_source(role, entry, sources)) for role, entry in manifest["sources"].items()}

    cfg = manifest["config"]
    if n_max is not None and "draft" in cfg and not 0 <= n_max < cfg["draft"]["block_size"]:
        raise ValueError(f"n_max must be in 0..{cfg['draft']['block_size'] - 1} for the draft's block size "
                         f"{cfg['draft']['block_size']} (0: no drafting), got {n_max}")
    check_weights(graphs, files, str(path))
    # the interpreter reads weights at its first call, not at load: its loads have no weight progress
    weights = FileWeights(files, graphs=graphs, progress=progress if be.name != "numpy" else lambda msg: None)
    need = check_fits(graphs, files, n_ctx=cfg["n_ctx"], block_size=_block_size(cfg.get("draft")),
                      dequantised=be.name == "numpy", where=str(path), progress=progress)
    programs = {}
    for i, (name, entry) in enumerate(manifest["programs"].items(), 1):
        progress(f"[{i}/{len(manifest['programs'])}] loading {name} on {be.name}, {cfg['numerics']} numerics")
        programs[name] = _load_program(be, name, graphs[name], entry["backend"], path, weights)
    engine = make_engine(programs, n_ctx=cfg["n_ctx"], n_max=cfg["n_max"] if n_max is None else n_max,
                         draft_cfg=cfg.get("draft"),
                         target_meta=files["target"].metadata if load_tokenizer else None,
                         target_source=str(files["target"].path), draft_vocab=_draft_vocab(files, cfg),
                         info={"artifact": str(path), "backend": manifest["backend"], "sources": manifest["sources"],
                               "numerics": cfg["numerics"], "memory_need": need})
    if measure_costs and engine.draft is not None:
        from dflash_ir.runtime.costs import acceptance_file, artifact_costs

        progress("measuring round costs on this device (once per artifact; the first launch of each kernel size builds it)")
        manifest_text = (path / "manifest.yaml").read_text()
        engine.costs = artifact_costs(engine, manifest_text, be, progress)
        engine.remember_acceptance(acceptance_file(manifest_text))
    return engine
