"""Fuzz targets for what reads untrusted bytes, and the bounded campaign `make fuzz` runs.

Each target takes the fuzzer's bytes and lets through only the errors its code documents
for bad input; anything else (an IndexError deep in numpy, a KeyError, a RecursionError)
is raised as a FuzzFinding, which the fuzzer reports as a crash. tests/fuzz replays every
input kept in tests/fuzz/regressions/<target>/ through the same function, without atheris.

- gguf: the bytes as a GGUF file: header parser, model config, tensor table, dequantising
  every tensor (seeds: a one-layer target and its draft, 37 KB and 25 KB).
- artifact: an even first byte makes the rest a manifest body, which gets its digest line
  and goes through read_manifest and load_graphs; an odd one a graph file, through strict
  YAML, the graph reader and the verifier (seeds: a compiled one-layer artifact's).
- tokenizer: the bytes as a stream of choices building tokenizer.ggml.* metadata (choice 0
  is well formed: byte characters, merged tokens with their merges, special tokens; each
  other choice breaks one token, type, merge or id), then the rest as text to encode,
  decode and stream-decode.

    python -m dflash_ir.fuzzing campaign [--runs 100000] [--work build/fuzz]   # all three
    python -m dflash_ir.fuzzing run gguf CORPUS_DIR -runs=1000 ...              # one, libFuzzer flags

`campaign` runs each target in its own process (atheris + libFuzzer, instrumenting the
dflash_ir modules), prints executions, coverage and findings per target, and writes them to
WORK/summary.json; crashing inputs land in WORK/<target>/crashes/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

MAX_LEN = {"gguf": 48 << 10, "artifact": 64 << 10, "tokenizer": 4 << 10}


class FuzzFinding(Exception):
    """A target let through an error its code does not document for bad input."""


def _expect(call: Callable[[], object], allowed: tuple[type[BaseException], ...]) -> bool:
    """Run `call`; True when it returned, False when it raised an allowed error."""
    try:
        call()
    except allowed:
        return False
    except Exception as e:
        raise FuzzFinding(f"{type(e).__name__}: {e}") from e
    return True


# -- targets ------------------------------------------------------------------------------


def gguf_target(data: bytes) -> None:
    from dflash_ir.models.config import DraftConfig, TargetConfig
    from dflash_ir.models.gguf_file import GGUFError, open_gguf
    from dflash_ir.models.tensors import validate_tensors

    with tempfile.NamedTemporaryFile(suffix=".gguf", dir=_scratch()) as f:
        f.write(data)
        f.flush()

        def read() -> None:
            with open_gguf(f.name) as gguf:
                role = DraftConfig if gguf.metadata.get("general.architecture") == "dflash" else TargetConfig
                validate_tensors(gguf, role.from_gguf(gguf))
                for name in gguf.tensors:
                    gguf.dequantize(name)

        _expect(read, (GGUFError,))


def artifact_target(data: bytes) -> None:
    from dflash_ir.artifact import load_graphs, read_manifest
    from dflash_ir.errors import ArtifactError
    from dflash_ir.integrity import MANIFEST, with_digest
    from dflash_ir.serialize import GraphFormatError, load_yaml
    from dflash_ir.strict_yaml import StrictYAMLError
    from dflash_ir.verifier import VerifyError, verify

    if not data[:1] or data[0] % 2 == 0:
        with tempfile.TemporaryDirectory(dir=_scratch()) as folder:
            text, _ = with_digest(data[1:].decode("utf-8", "replace"))
            (Path(folder) / MANIFEST).write_text(text)
            _expect(lambda: load_graphs(Path(folder), read_manifest(folder)), (ArtifactError,))
    else:
        _expect(lambda: verify(load_yaml(data[1:].decode("utf-8"), "graph.yaml")),
                (UnicodeDecodeError, StrictYAMLError, GraphFormatError, VerifyError))


def tokenizer_target(data: bytes) -> None:
    from dflash_ir.models.tokenizer import Tokenizer, TokenizerError

    choices = _Choices(data)
    metadata = _tokenizer_metadata(choices)
    text = choices.rest().decode("utf-8", "replace")
    built: list = []
    if not _expect(lambda: built.append(Tokenizer.from_metadata(metadata, source="fuzz.gguf")), (TokenizerError,)):
        return
    tokenizer = built[0]

    def use() -> None:
        for parse_special in (True, False):
            ids = tokenizer.encode(text, parse_special=parse_special, add_special=True)
            if any(not 0 <= i < tokenizer.vocab_size for i in ids):
                raise FuzzFinding(f"encode gave ids outside the vocabulary: {ids}")
            tokenizer.decode(ids)
            stream = tokenizer.stream_decoder()
            "".join(stream.feed(i) for i in ids) + stream.flush()

    _expect(use, ())


TARGETS: dict[str, Callable[[bytes], None]] = {"gguf": gguf_target, "artifact": artifact_target,
                                               "tokenizer": tokenizer_target}


class _Choices:
    """The fuzzer's bytes read as a stream of choices (atheris's FuzzedDataProvider in
    miniature, so regression inputs replay without atheris); past the end every choice is 0."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def int(self, n: int) -> int:
        """A number in 0..n-1."""
        value = int.from_bytes(self.data[self.pos:self.pos + 2], "little")
        self.pos += 2
        return value % n

    def text(self, max_len: int) -> str:
        length = self.int(max_len + 1)
        chunk = self.data[self.pos:self.pos + length]
        self.pos += length
        return chunk.decode("utf-8", "replace")

    def rest(self) -> bytes:
        return self.data[self.pos:]


def _tokenizer_metadata(c: _Choices) -> dict:
    """Metadata where choice 0 (and the end of the input) is the well-formed option: byte
    characters, then merged tokens whose merges are in the vocabulary, then special tokens;
    the other choices break one thing (a token, a type, a merge, an id) at a time."""
    from dflash_ir.models.tokenizer import BYTE_TO_UNICODE

    alphabet = list(BYTE_TO_UNICODE.values())
    tokens = [alphabet[c.int(256)] for _ in range(1 + c.int(24))]
    types = [1] * len(tokens)
    merges = []
    for _ in range(c.int(24)):
        a, b = tokens[c.int(len(tokens))], tokens[c.int(len(tokens))]
        broken = c.int(16)
        merges.append({15: a + b, 14: f"{a} {c.text(3)}"}.get(broken, f"{a} {b}"))
        tokens.append(a + b if broken != 13 else c.text(4))
        types.append(1)
    for _ in range(c.int(6)):
        tokens.append(f"<|{c.text(4)}|>")
        types.append([3, 4, 1, 2, 5, 6, 0, 9][c.int(8)])
    metadata = {"tokenizer.ggml.model": "gpt2" if c.int(16) != 15 else c.text(5),
                "tokenizer.ggml.pre": ["qwen35", "qwen2", "llama-bpe"][c.int(3)], "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.merges": merges}
    if c.int(8) != 7:
        length = [len(types), len(types) - 1, len(types) + 1][c.int(3)]
        metadata["tokenizer.ggml.token_type"] = (types + [1])[:length]
    n = len(tokens)
    for key in ("eos_token_id", "bos_token_id", "padding_token_id", "eot_token_id"):
        value = [c.int(n), None, n + c.int(4), str(c.int(n)), -1][c.int(5)]
        if value is not None:
            metadata[f"tokenizer.ggml.{key}"] = value
    add_bos = [False, True, None, 1][c.int(4)]
    if add_bos is not None:
        metadata["tokenizer.ggml.add_bos_token"] = add_bos
    return metadata


def _scratch() -> str:
    """Files the targets write go to memory where the machine has a tmpfs."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


# -- seeds --------------------------------------------------------------------------------


def write_seeds(name: str, corpus: Path) -> None:
    """Valid inputs of target `name` in `corpus`: the campaign starts from them."""
    corpus.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for seed, data in _seeds(name, Path(tmp)).items():
            (corpus / seed).write_bytes(data)


def _seeds(name: str, tmp: Path) -> dict[str, bytes]:
    from dflash_ir.artifact import compile_pair
    from dflash_ir.integrity import MANIFEST
    from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target

    if name == "tokenizer":
        return {"zeros": bytes(64), "counting": bytes(range(256)) * 4}
    cfg = tiny_target_config("qwen35", hidden=32, n_layer=1, n_head=2, n_head_kv=1, head_dim=16, ssm_d_state=8,
                             ssm_n_group=1, ssm_dt_rank=2, ff=32, vocab_size=288)
    draft_cfg = tiny_draft_config(cfg, n_layer=1, n_head=2, head_dim=16, ff=32)
    target = write_target(tmp / "target.gguf", cfg, dtype="f16", seed=1)
    draft = write_draft(tmp / "draft.gguf", draft_cfg, target_cfg=cfg, dtype="f16", seed=2)
    if name == "gguf":
        return {"target.gguf": target.read_bytes(), "draft.gguf": draft.read_bytes()}
    out = compile_pair(target, draft, out=tmp / "artifact", n_ctx=64)
    body = (out / MANIFEST).read_bytes().rsplit(b"digest: ", 1)[0]
    graphs = {f"{p.stem}": b"\x01" + p.read_bytes() for p in (out / "graphs").iterdir()}
    return {"manifest": b"\x00" + body, **graphs}


# -- the campaign -------------------------------------------------------------------------

_STAT = re.compile(r"stat::(\w+):\s*(\d+)")
_COVERAGE = re.compile(r"#\d+\s+\w+\s+cov: (\d+) ft: (\d+)")


def run(name: str, libfuzzer_args: list[str]) -> None:
    """Fuzz one target in this process (atheris instruments the dflash_ir modules it imports)."""
    import atheris

    with atheris.instrument_imports(include=["dflash_ir"]):
        TARGETS[name](b"")   # imports every module the target reaches, instrumented
    atheris.Setup([sys.argv[0], *libfuzzer_args], TARGETS[name])
    atheris.Fuzz()


def campaign(runs: int, work: Path, names: list[str]) -> dict[str, dict]:
    """Each target for `runs` executions from its seeds; executions, coverage and findings."""
    summary = {}
    for name in names:
        folder = work / name
        corpus, crashes = folder / "corpus", folder / "crashes"
        write_seeds(name, corpus)
        crashes.mkdir(parents=True, exist_ok=True)
        args = [str(corpus), f"-runs={runs}", f"-max_len={MAX_LEN[name]}", "-print_final_stats=1", "-timeout=20",
                "-rss_limit_mb=4096", f"-artifact_prefix={crashes}/"]
        print(f"fuzz {name}: {runs} executions from {len(list(corpus.iterdir()))} seeds ...", flush=True)
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "dflash_ir.fuzzing", "run", name, *args], capture_output=True,
                              text=True)
        (folder / "log.txt").write_text(done.stdout + done.stderr)
        stats = {k: int(v) for k, v in _STAT.findall(done.stderr)}
        coverage = _COVERAGE.findall(done.stderr)
        summary[name] = {"executions": stats.get("number_of_executed_units", 0),
                         "coverage_edges": int(coverage[-1][0]) if coverage else 0,
                         "features": int(coverage[-1][1]) if coverage else 0,
                         "corpus": len(list(corpus.iterdir())), "seconds": round(time.monotonic() - start),
                         "findings": sorted(p.name for p in crashes.iterdir()), "exit_code": done.returncode}
        print(f"fuzz {name}: {json.dumps(summary[name])}", flush=True)
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        run(argv[1], argv[2:])
        return 0
    p = argparse.ArgumentParser(prog="python -m dflash_ir.fuzzing", description="The bounded fuzz campaign.")
    p.add_argument("command", choices=["campaign"])
    p.add_argument("--runs", type=int, default=100_000, help="executions per target (default 100000)")
    p.add_argument("--work", type=Path, default=Path("build/fuzz"), help="corpora, logs, crashes (default build/fuzz)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated (default {','.join(TARGETS)})")
    args = p.parse_args(argv)
    summary = campaign(args.runs, args.work, args.targets.split(","))
    return 1 if any(s["findings"] or s["exit_code"] for s in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
