"""`dflash-serve`: llama-server's command line for dflash-ir.

    dflash-serve -m target.gguf -md draft.gguf --spec-type draft-dflash --spec-draft-n-max 15 \\
                 -ngl 99 -fa on --jinja -c 10000 --host 0.0.0.0 --port 8080
    dflash-serve --artifact out/ -np 2 --api-key secret
    dflash-serve --artifact out/ -np 2 --ray --replicas 2      # 2 engines behind one endpoint (Ray Serve)

Flags are llama-server's where they mean something here; llama-server flags that tune what
dflash-ir decides itself (GPU layers, flash attention, threads) are accepted and reported
as ignored, so a llama-server command line works after changing the command name.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_ir.artifact import DEFAULT_CTX
from dflash_ir.cli.args import integer, number
from dflash_ir.cli.compile import add_compile_args, resolve_backend
from dflash_ir.errors import ArtifactError
from dflash_ir.runtime.sampling import SamplingParams

from .artifact_cache import cached_artifact, default_cache_dir, load_or_compile
from .scheduler import speculates

# llama-server flags that do not apply to dflash-ir: (names, takes a value, why)
IGNORED = (
    (("-ngl", "--n-gpu-layers", "--gpu-layers"), True, "the backend places the whole model on its device"),
    (("-ngld", "--n-gpu-layers-draft"), True, "the backend places the whole draft on its device"),
    (("-fa", "--flash-attn"), "?", "attention is always fused (fused_attention pass)"),
    (("-t", "--threads"), True, "the backend's runtime picks its threads"),
    (("--metrics",), False, "/metrics is always on"),
    (("--cont-batching", "-cb"), False, "busy slots always advance together, round by round"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-serve", description="OpenAI-compatible HTTP server for DFlash "
                                "speculative decoding, with llama-server's flags.")
    m = p.add_argument_group("model")
    m.add_argument("--artifact", help="artifact folder from dflash-compile")
    m.add_argument("-m", "--model", help="target GGUF, compiled on first start into --cache-dir")
    m.add_argument("-md", "--model-draft", help="DFlash draft GGUF")
    m.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help=f"where -m/-md artifacts are compiled and reused (default {default_cache_dir()})")
    add_compile_args(m)
    m.add_argument("--spec-type", default="draft-dflash", choices=["draft-dflash"],
                   help="speculative decoding type: draft-dflash (the only one)")
    m.add_argument("--no-spec", action="store_true", help="target only: no speculative decoding")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=integer(0, 65535), default=8080, help="port to listen on (default 8080)")
    s.add_argument("-np", "--parallel", type=integer(1), default=1, help="slots: sequences served at once (default 1)")
    s.add_argument("--no-batch-verify", action="store_true",
                   help="verify each slot's block in a pass of its own (default: the busy slots' blocks together, "
                   "one target pass for all of them)")
    s.add_argument("--queue-size", type=integer(0), default=64,
                   help="requests that may wait for a slot; past it 503 + Retry-After (default 64)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or X-Api-Key) on every API route")
    s.add_argument("--alias", help="model name in the API (default: the target GGUF's file name)")
    s.add_argument("--max-body-bytes", type=integer(1), default=8 << 20,
                   help="largest request body (default 8 MiB; 413 past it)")
    g = p.add_argument_group("generation defaults (a request's own fields win)")
    g.add_argument("-n", "--n-predict", type=integer(-1), default=-1, help="max tokens when a request gives none "
                   "(default -1: until the context is full; 0: read the prompt only)")
    g.add_argument("--temp", type=number(0), default=0.8, help="temperature, 0 = greedy (default 0.8, as llama-server)")
    g.add_argument("--top-k", type=integer(0), default=40, help="0 = off (default 40)")
    g.add_argument("--top-p", type=number(0, 1, low_open=True), default=0.95, help="in (0, 1], 1 = off (default 0.95)")
    g.add_argument("--min-p", type=number(0, 1, high_open=True), default=0.05, help="in [0, 1), 0 = off (default 0.05)")
    g.add_argument("--seed", type=integer(-1, 2**63 - 1), default=-1, help="sampling seed, -1 = random (default -1)")
    g.add_argument("--jinja", action="store_true", help="accepted: the GGUF's Jinja chat template is always used")
    g.add_argument("--chat-template-kwargs", type=_json_object, default={},
                   help='JSON object of chat template variables, e.g. \'{"enable_thinking": false}\'')
    r = p.add_argument_group("replicas on Ray Serve (pip install 'dflash-ir[ray]')")
    r.add_argument("--ray", action="store_true", help="serve --replicas engines, each with -np slots, as a Ray Serve "
                   "deployment behind one endpoint; the artifact is compiled once, before they start")
    r.add_argument("--replicas", type=integer(1), help="replicas to start with (default 1, or --min-replicas)")
    r.add_argument("--min-replicas", type=integer(0), help="autoscaling lower bound (Ray adds replicas while "
                   "slots are full, removes idle ones)")
    r.add_argument("--max-replicas", type=integer(1), help="autoscaling upper bound")
    r.add_argument("--replica-cpus", type=number(0), default=0.5, help="Ray CPUs a replica reserves (default 0.5)")
    r.add_argument("--replica-timeout", type=number(0, low_open=True), default=600,
                   help="seconds a request may wait for a replica's next reply piece, queueing included; past "
                   "it 504 (default 600)")
    r.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    i = p.add_argument_group("llama-server flags accepted and ignored")
    for names, value, why in IGNORED:
        kw = {"nargs": "?", "const": True} if value == "?" else {} if value else {"action": "store_true"}
        i.add_argument(*names, dest=f"ignored_{names[-1].lstrip('-').replace('-', '_')}", help=f"ignored: {why}", **kw)
    return p


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def _check(p: argparse.ArgumentParser, args) -> None:
    if bool(args.artifact) == bool(args.model):
        p.error("give either --artifact DIR or -m TARGET.gguf [-md DRAFT.gguf]")
    if args.model_draft and not args.model:
        p.error("-md needs -m")
    for flag, path in (("-m", args.model), ("-md", args.model_draft)):
        if path and not Path(path).is_file():
            p.error(f"{flag}: no such file: {path}")
    ray_only = [f for f, v in (("--replicas", args.replicas), ("--min-replicas", args.min_replicas),
                               ("--max-replicas", args.max_replicas), ("--ray-address", args.ray_address))
                if v is not None]
    if ray_only and not args.ray:
        p.error(f"{ray_only[0]} needs --ray")
    if args.ray:
        lo, hi = args.min_replicas, args.max_replicas
        if lo is not None and hi is not None and lo > hi:
            p.error(f"--min-replicas {lo} is above --max-replicas {hi}")
        if args.replicas is None:
            args.replicas = max(lo or 1, 1)
        if lo is not None and args.replicas < lo:
            p.error(f"--replicas {args.replicas} is below --min-replicas {lo}")
        if hi is not None and args.replicas > hi:
            p.error(f"--replicas {args.replicas} is above --max-replicas {hi}")
        from .ray_serve import import_ray

        try:
            import_ray(loopback=args.ray_address is None)
        except RuntimeError as e:
            p.error(str(e))


def _artifact_alias(p: argparse.ArgumentParser, args) -> str:
    """The API model name: --alias, else the target GGUF's file name (checks an --artifact now)."""
    if args.model:
        return args.alias or Path(args.model).name
    from dflash_ir.artifact import read_manifest

    if args.ctx_size is not None:
        p.error("-c applies when compiling (with -m); an artifact keeps the context it was compiled for "
                "(dflash-compile -c N)")
    try:
        manifest = read_manifest(args.artifact)
    except ArtifactError as e:
        p.error(str(e))
    return args.alias or Path(manifest["sources"]["target"]["path"]).name


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    _check(p, args)
    alias = _artifact_alias(p, args)
    for names, _, why in IGNORED:
        if getattr(args, f"ignored_{names[-1].lstrip('-').replace('-', '_')}") not in (None, False):
            _say(f"{names[0]} ignored: {why}")

    from .app import ServeConfig

    def load():
        from dflash_ir.artifact import load_compiled

        if args.artifact:
            _say(f"loading {args.artifact}")
            engine = load_compiled(args.artifact, n_max=args.spec_draft_n_max)
        else:
            engine = load_or_compile(Path(args.model), Path(args.model_draft) if args.model_draft else None,
                                     cache_dir=args.cache_dir, backend=resolve_backend(args.backend),
                                     n_ctx=DEFAULT_CTX if args.ctx_size is None else args.ctx_size,
                                     n_max=args.spec_draft_n_max, opt_level=args.opt_level, numerics=args.numerics,
                                     dump_dir=args.dump_ir, progress=_say)
        spec = "speculative (DFlash)" if speculates(engine, not args.no_spec) else "target only"
        _say(f"ready: model '{alias}', {args.parallel} slot(s), context {engine.n_ctx}, {spec}, "
             f"backend {engine.info.get('backend', {}).get('name')}")
        return engine

    config = ServeConfig(alias=alias, n_slots=args.parallel, queue_size=args.queue_size, api_key=args.api_key,
                         max_body_bytes=args.max_body_bytes, speculative=not args.no_spec, max_tokens=args.n_predict,
                         sampling=SamplingParams(args.temp, args.top_k, args.top_p, args.min_p,
                                                 None if args.seed == -1 else args.seed),
                         template_kwargs=args.chat_template_kwargs, batch_verify=not args.no_batch_verify)
    if args.ray:
        return _serve_on_ray(args, config)
    return _serve(args, config, load)


def _serve(args, config, load) -> int:
    """The plain server: one engine, its slots, uvicorn."""
    import uvicorn

    from .app import ServerState, create_app

    failures: list[BaseException] = []

    def on_failure(e: BaseException) -> None:
        failures.append(e)
        _say(f"error: {e}")
        server.should_exit = True

    server = uvicorn.Server(uvicorn.Config(create_app(ServerState(config, load, on_failure)), host=args.host,
                                           port=args.port, timeout_graceful_shutdown=5))
    _say(f"starting on http://{args.host}:{args.port} (chat page at /, API at /v1); the model loads meanwhile")
    server.run()
    return 1 if failures else 0


def _serve_on_ray(args, config) -> int:
    """Replicas on Ray Serve: the artifact compiled (or found in the cache) here, once; each
    replica loads it."""
    from .ray_serve import Scaling, serve_replicas

    if args.artifact:
        folder = Path(args.artifact)
    else:
        from dflash_ir.artifact import read_manifest

        folder = cached_artifact(Path(args.model), Path(args.model_draft) if args.model_draft else None,
                                 cache_dir=args.cache_dir, backend=resolve_backend(args.backend),
                                 n_ctx=DEFAULT_CTX if args.ctx_size is None else args.ctx_size,
                                 n_max=args.spec_draft_n_max, opt_level=args.opt_level, numerics=args.numerics,
                                 dump_dir=args.dump_ir, progress=_say, check=read_manifest)
    scaling = Scaling(args.replicas, args.min_replicas, args.max_replicas, args.replica_cpus, args.replica_timeout)
    return serve_replicas(folder.resolve(), config, scaling, n_max=args.spec_draft_n_max, host=args.host,
                          port=args.port, address=args.ray_address, say=_say)


def _say(msg: str) -> None:
    print(f"dflash-serve: {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
