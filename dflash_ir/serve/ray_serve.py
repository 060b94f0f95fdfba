"""`dflash-serve --ray`: N replicas of the engine as a Ray Serve deployment behind one
OpenAI-compatible endpoint.

Two deployments. `EngineReplica` loads the compiled artifact and runs the plain server's app
(app.py: the same routes, shapes and errors) on requests relayed to it; Ray sends a replica at
most as many requests as it has slots (max_ongoing_requests), the rest wait in Ray's queue
(--queue-size) for the first free slot. `Front` is the HTTP ingress: it relays each request
to a replica and turns a replica that dies or stalls into an OpenAI-shaped 5xx (relay.py);
Ray's controller replaces the dead replica. Ray is imported only here, on `--ray`.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from starlette.requests import Request
from starlette.responses import Response

from . import openai_api as api
from .app import ServeConfig, ServerState, create_app
from .relay import call_app, portable_scope, relay

EXTRA = "ray"  # pyproject's optional extra that installs ray[serve]
OBJECT_STORE_BYTES = 128 << 20  # a local cluster's shared memory: requests and replies are small


@dataclass(frozen=True)
class Scaling:
    """How many replicas and what each may use (cli.py has the flags' meanings)."""
    replicas: int
    min_replicas: int | None
    max_replicas: int | None
    replica_cpus: float
    timeout: float

    def engine_options(self, slots: int, queue_size: int) -> dict:
        """The engine deployment's Ray Serve options: a replica takes at most `slots` requests
        at once, `queue_size` more wait for the first free slot; fixed or autoscaled replicas."""
        options = {"max_ongoing_requests": slots, "max_queued_requests": queue_size,
                   "ray_actor_options": {"num_cpus": self.replica_cpus}, "health_check_period_s": 2,
                   "graceful_shutdown_timeout_s": 5}
        if self.min_replicas is None and self.max_replicas is None:
            return {**options, "num_replicas": self.replicas}
        lo = self.replicas if self.min_replicas is None else self.min_replicas
        hi = self.replicas if self.max_replicas is None else self.max_replicas
        return {**options, "autoscaling_config": {"min_replicas": lo, "max_replicas": hi,
                                                  "initial_replicas": self.replicas, "target_ongoing_requests": slots}}


def import_ray(*, loopback: bool):
    """ray and ray.serve, or an error that names the extra to install. With `loopback`, a
    local cluster that this process starts talks over 127.0.0.1 only (Ray's switch for
    one-machine clusters; without it Ray's processes use the machine's network address)."""
    if loopback:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise RuntimeError(f"--ray needs Ray Serve, which is not installed ({e}): "
                           f"pip install 'dflash-ir[{EXTRA}]' (or pip install 'ray[serve]')") from None
    return ray, serve


class EngineReplica:
    """One engine with the plain server's app on it; its failure fails Ray's health check,
    so Ray replaces the replica."""

    def __init__(self, artifact: str, config: ServeConfig, n_max: int | None):
        from dflash_ir.artifact import load_compiled

        engine = load_compiled(artifact, n_max=n_max)
        self._failure: BaseException | None = None
        self._state = ServerState(config, lambda: engine, self._failed)
        self._app = create_app(self._state)
        self._state.start()
        while not self._state.ready and self._failure is None:
            time.sleep(0.01)
        self.check_health()

    def _failed(self, e: BaseException) -> None:
        self._failure = e

    async def forward(self, scope: dict, body: bytes):
        async for piece in call_app(self._app, scope, body):
            yield piece

    def check_health(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the engine failed: {self._failure}")
        if not self._state.running:
            raise RuntimeError("the engine's scheduler thread stopped")

    def __del__(self):
        self._state.stop()


class Front:
    """The HTTP ingress: every route goes to a replica with a free slot."""

    def __init__(self, engines, timeout: float):
        self._engines, self._timeout = engines.options(stream=True), timeout

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        call = self._engines.forward.remote(portable_scope(request.scope), body)
        return await relay(call, timeout=self._timeout, describe=describe_failure, cancel=call.cancel)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def describe_failure(e: BaseException) -> api.RequestError:
    """The client's error for a request whose replica could not answer."""
    retry = {"Retry-After": "1"}
    if type(e).__name__ == "BackPressureError":
        return api.RequestError("every replica's slots and the queue (--queue-size) are full; retry later",
                                status=503, type="unavailable_error", code="queue_full", headers=retry)
    if isinstance(e, TimeoutError):
        return api.RequestError(f"{e} (--replica-timeout)", status=504, type="server_error", code="timeout")
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return api.RequestError(f"the replica serving this request failed ({type(e).__name__}: {first_line}); "
                            "Ray restarts it: retry", status=503, type="server_error", code="replica_failed",
                            headers=retry)


def serve_replicas(artifact: Path, config: ServeConfig, scaling: Scaling, *, n_max: int | None, host: str,
                   port: int, address: str | None, say: Callable[[str], None]) -> int:
    """Start (or join, with `address`) a Ray cluster, deploy, and serve until SIGINT/SIGTERM."""
    ray, serve = import_ray(loopback=address is None)
    if address is None:
        ray.init(include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    signal.signal(signal.SIGTERM, _interrupt)  # as SIGINT: stops a start half-way too
    serving = False
    try:
        say(f"ray cluster at {ray.get_runtime_context().gcs_address}; starting {scaling.replicas} replica(s) of "
            f"{artifact}")
        serve.start(http_options={"host": host, "port": port})
        serving = True
        engines = serve.deployment(EngineReplica, name="dflash-engine").options(
            **scaling.engine_options(config.n_slots, config.queue_size))
        front = serve.deployment(Front, name="dflash-front").options(
            num_replicas=1, max_ongoing_requests=1 << 16, ray_actor_options={"num_cpus": 0})
        try:
            serve.run(front.bind(engines.bind(str(artifact), config, n_max), scaling.timeout), name="dflash-serve",
                      route_prefix="/")
        except Exception as e:  # replicas that failed to start: Ray keeps their errors in the status
            app = serve.status().applications.get("dflash-serve")
            why = [d.message.strip().splitlines()[-1] for d in (app.deployments.values() if app else ())
                   if d.message.strip()]
            say(f"error: the replicas did not start: {'; '.join(why) or e}")
            return 1
        say(f"ready: model '{config.alias}', {scaling.replicas} replica(s) x {config.n_slots} slot(s) on "
            f"http://{host}:{port} (API at /v1)")
        threading.Event().wait()
    except KeyboardInterrupt:
        say("stopping")
    finally:
        if serving:
            serve.shutdown()
        ray.shutdown()
    return 0
