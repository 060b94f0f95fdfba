"""dflash-serve --ray: its flags, the error without Ray, the scaling options, and (slow, on a
local loopback Ray cluster) 2 replicas of the demo pair behind one endpoint that lose a replica
in the middle of 100 requests from 8 clients."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from dflash_ir.artifact import read_manifest
from dflash_ir.serve import cli, ray_serve
from dflash_ir.serve.ray_serve import Scaling, describe_failure

from .conftest import DRAFT, TARGET, ServerProcess, request
from .test_api import expected_text

REQUESTS, CLIENTS, LENGTHS = 100, 8, (8, 16, 24)
KILL_AFTER = 30  # requests answered before a replica is killed
RUN_LIMIT_S = 300  # the whole kill run; each request has the openai client's timeout below it
REQUEST_TIMEOUT_S = 120
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="dflash-serve --ray needs the 'ray' extra (pip install 'dflash-ir[ray]')")


def exit_message(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--max-replicas", "2"], "--max-replicas needs --ray"),
    (["--ray", "--replicas", "1", "--min-replicas", "2"], "--replicas 1 is below --min-replicas 2"),
    (["--ray", "--replicas", "3", "--max-replicas", "2"], "--replicas 3 is above --max-replicas 2"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is above --max-replicas 2"),
    (["--ray", "--max-replicas", "1", "--min-replicas", "0"], None),
])
def test_replica_flags_are_checked(capsys, monkeypatch, argv, says):
    started = []
    monkeypatch.setattr(ray_serve, "import_ray", lambda **_: (None, None))
    monkeypatch.setattr(cli, "_serve_on_ray", lambda args, config: started.append(args.replicas) or 0)
    if says is None:  # within bounds: the replicas start, as many as the lower bound (at least 1)
        assert cli.main(["-m", str(TARGET), *argv]) == 0 and started == [1]
    else:
        assert says in exit_message(capsys, ["-m", str(TARGET), *argv]) and not started


def test_ray_flag_without_ray_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` does when it is not installed
    message = exit_message(capsys, ["-m", str(TARGET), "--ray"])
    assert "--ray needs Ray Serve, which is not installed" in message and "pip install 'dflash-ir[ray]'" in message


def test_a_replica_takes_its_slots_worth_and_scales_within_the_flags_bounds():
    fixed = Scaling(2, None, None, 0.5, 60).engine_options(slots=2, queue_size=64)
    assert fixed == {"max_ongoing_requests": 2, "max_queued_requests": 64, "ray_actor_options": {"num_cpus": 0.5},
                     "health_check_period_s": 2, "graceful_shutdown_timeout_s": 5, "num_replicas": 2}
    scaled = Scaling(2, 1, 4, 0.25, 60).engine_options(slots=3, queue_size=8)
    assert "num_replicas" not in scaled and scaled["max_ongoing_requests"] == 3
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                            "target_ongoing_requests": 3}
    assert Scaling(2, None, 4, 0.5, 60).engine_options(1, 0)["autoscaling_config"]["min_replicas"] == 2


def test_the_pair_is_compiled_once_before_the_replicas_start(capsys, monkeypatch, tmp_path):
    started = []
    monkeypatch.setattr(ray_serve, "import_ray", lambda **_: (None, None))  # Ray itself is not needed here
    monkeypatch.setattr(ray_serve, "serve_replicas", lambda folder, config, scaling, **kw: started.append(folder) or 0)
    argv = ["-m", str(TARGET), "-md", str(DRAFT), "--backend", "numpy", "-c", "256", "--cache-dir", str(tmp_path),
            "-np", "3", "--ray", "--replicas", "2"]
    assert cli.main(argv) == 0
    assert "compiling coder-target-q8_0.gguf + coder-dflash-q8_0.gguf for numpy" in capsys.readouterr().err
    assert cli.main(argv) == 0
    assert "reusing the compiled artifact" in capsys.readouterr().err
    assert started[0] == started[1] and started[0].parent == tmp_path
    assert read_manifest(started[0])["config"]["n_ctx"] == 256


def test_failures_are_openai_errors():
    class BackPressureError(Exception):  # Ray Serve's queue-full error, told by name (ray stays optional)
        pass

    full = describe_failure(BackPressureError("queue"))
    assert (full.status, full.code, full.headers) == (503, "queue_full", {"Retry-After": "1"})
    late = describe_failure(TimeoutError("no answer from the replica for 5 s"))
    assert (late.status, late.code, late.message) == (504, "timeout", "no answer from the replica for 5 s "
                                                                     "(--replica-timeout)")
    died = describe_failure(RuntimeError("The actor died unexpectedly.\ntraceback..."))
    assert died.status == 503 and died.code == "replica_failed" and died.body()["error"]["message"] == (
        "the replica serving this request failed (RuntimeError: The actor died unexpectedly.); Ray restarts it: retry")


# -- a local Ray cluster ------------------------------------------------------------------

RAY_SCRIPT = """
import json, os, sys
import ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
replicas = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::dflash-serve#dflash-engine#"))
if sys.argv[2] == "kill":
    ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
running = serve.status().applications["dflash-serve"].deployments["dflash-engine"].replica_states.get("RUNNING", 0)
print(json.dumps({"replicas": replicas, "running": running}))
"""


def ray_call(address: str, what: str) -> dict:
    """Replica actor names and the RUNNING count from the server's cluster; 'kill' first kills
    one replica with ray.kill. In a child process: this one stays out of Ray."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # the cluster is on 127.0.0.1 (ray_serve.py)
           "RAY_AUTH_MODE": "token"}  # with the token the server's ray.init saved in ~/.ray
    out = subprocess.run([sys.executable, "-c", RAY_SCRIPT, address, what], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def ask(client, model_id: str, prompt: str, n: int, stream: bool):
    """(text, completion tokens, finish reason) of one completion, or the openai error."""
    from openai import APIError

    try:
        if not stream:
            r = client.completions.create(model=model_id, prompt=prompt, max_tokens=n, temperature=0)
            return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason
        text, finish, tokens = "", None, 0
        for chunk in client.completions.create(model=model_id, prompt=prompt, max_tokens=n, temperature=0,
                                               stream=True):
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            tokens = (getattr(chunk, "timings", None) or {}).get("predicted_n", tokens)
        return text, tokens, finish
    except APIError as e:
        return e


@pytest.mark.slow
@pytest.mark.ray
@needs_ray
def test_two_replicas_lose_one_mid_run(demo_artifact, engine, prompts, tmp_path):
    from openai import OpenAI

    want = {}
    for p in prompts:
        for n in LENGTHS:
            gen = engine.generate(p, max_tokens=n)
            want[p, n] = (expected_text(engine, gen), len(gen.tokens),
                          "stop" if gen.stats.stop_reason == "eos" else "length")
    server = ServerProcess(["--artifact", str(demo_artifact), "-np", "2", "--temp", "0", "--ray", "--replicas", "2",
                            "--replica-cpus", "0.5", "--replica-timeout", "60"], tmp_path / "server.log")
    try:
        server.wait_ready(timeout=600)  # the first replica answers /health before the second is up
        deadline = time.monotonic() + 300
        while "dflash-serve: ready:" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.5)
        address = re.search(r"ray cluster at (\S+);", server.log()).group(1)
        assert address.startswith("127.0.0.1:")  # loopback only
        before = ray_call(address, "status")
        assert len(before["replicas"]) == 2 and before["running"] == 2

        clients = [OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
                   for _ in range(CLIENTS)]
        model_id = clients[0].models.list().data[0].id
        jobs = [(prompts[i % len(prompts)], LENGTHS[i % len(LENGTHS)], i % 2 == 0) for i in range(REQUESTS)]
        start = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(ask, clients[i % CLIENTS], model_id, *job) for i, job in enumerate(jobs)]
            while sum(f.done() for f in futures) < KILL_AFTER and time.monotonic() - start < RUN_LIMIT_S:
                time.sleep(0.05)
            killed = ray_call(address, "kill")
            done, hanging = wait(futures, timeout=RUN_LIMIT_S - (time.monotonic() - start))
            assert not hanging, f"{len(hanging)} requests hang"
        results = [f.result() for f in futures]

        failed = [r for r in results if isinstance(r, Exception)]
        assert all(r == want[p, n] for (p, n, _), r in zip(jobs, results) if not isinstance(r, Exception))
        for e in failed:  # a clean failure: the relay's OpenAI error, as a 5xx or inside the stream
            assert e.body["code"] in ("replica_failed", "timeout") and "replica" in e.body["message"], e
            assert getattr(e, "status_code", 503) >= 500
        assert len(failed) < REQUESTS // 2, f"{len(failed)} of {REQUESTS} failed"

        def replaced(now: dict) -> bool:  # Ray notices the death, then starts a new replica
            return now["running"] == 2 and len(now["replicas"]) == 2 and killed["replicas"][0] not in now["replicas"]

        deadline = time.monotonic() + 300
        while not replaced(after := ray_call(address, "status")) and time.monotonic() < deadline:
            time.sleep(2)
        assert replaced(after), (killed, after)
        again = [ask(clients[i], model_id, prompts[i % len(prompts)], 16, i % 2 == 0) for i in range(4)]
        assert again == [want[prompts[i % len(prompts)], 16] for i in range(4)]
        assert request(server.port, "GET", "/health")[0] == 200
        print(f"\nray: {REQUESTS} requests, {CLIENTS} clients, 2 replicas x 2 slots, one killed after {KILL_AFTER}: "
              f"{len(failed)} failed cleanly, the rest equal the single-client result")
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.ray
@needs_ray
def test_replicas_that_cannot_load_stop_the_server_with_the_engines_error(tmp_path):
    """The driver only reads the manifest; a replica's full check finds the changed GGUF."""
    from dflash_ir import compile_pair

    for f in (TARGET, DRAFT):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    compile_pair(tmp_path / TARGET.name, tmp_path / DRAFT.name, out=tmp_path / "art", backend="numpy", n_ctx=256)
    with open(tmp_path / TARGET.name, "ab") as f:
        f.write(b"x")
    server = ServerProcess(["--artifact", str(tmp_path / "art"), "--ray"], tmp_path / "server.log")
    try:
        assert server.proc.wait(timeout=300) == 1
    finally:
        server.stop()
    errors = [line for line in server.log().splitlines() if line.startswith("dflash-serve: error:")]
    assert len(errors) == 1 and "the replicas did not start" in errors[0]
    assert "ArtifactError: the target GGUF" in errors[0] and "changed since compilation" in errors[0]


def test_a_replica_serves_the_plain_app_and_fails_its_health_check_when_its_engine_stops(demo_artifact, engine):
    """EngineReplica without Ray: the plain server's routes through the relay, then the
    health check Ray calls every 2 s once the scheduler thread has ended."""
    import asyncio

    from dflash_ir.runtime.sampling import SamplingParams
    from dflash_ir.serve.app import ServeConfig
    from dflash_ir.serve.relay import Head

    from .test_relay import scope

    config = ServeConfig(alias="demo", n_slots=1, queue_size=0, api_key=None, max_body_bytes=1 << 20,
                         speculative=True, max_tokens=4, sampling=SamplingParams(0, 40, 0.95, 0.05, None),
                         template_kwargs={})
    replica = ray_serve.EngineReplica(str(demo_artifact), config, None)  # costs measured once, by `engine`

    async def get(path: str) -> list:
        return [p async for p in replica.forward(scope("GET", path), b"")]

    head, body = asyncio.run(get("/v1/models"))
    assert isinstance(head, Head) and head.status == 200
    assert json.loads(body)["data"][0]["id"] == "demo" and json.loads(body)["data"][0]["meta"]["slots"] == 1
    replica.check_health()
    replica._state.stop()  # what an exception in the scheduler thread leaves
    with pytest.raises(RuntimeError, match="the engine's scheduler thread stopped"):
        replica.check_health()
