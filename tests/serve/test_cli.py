"""The dflash-serve command line: a llama-server command with only the name changed, the
compile cache, /health while loading, the API key, the queue bound, flag errors."""
import http.client
import importlib.metadata
import json
import subprocess
import sys

import pytest
from openai import AuthenticationError, OpenAI

from .conftest import DRAFT, TARGET, ServerProcess, request

LLAMA_SERVER_FLAGS = ["--spec-type", "draft-dflash", "--spec-draft-n-max", "15", "-ngl", "99", "-fa", "on", "--jinja",
                      "-c", "512", "--host", "127.0.0.1", "-cb"]


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """`-m/-md` with llama-server's flags: compiles into a fresh cache, 1 slot, no queue, a key."""
    folder = tmp_path_factory.mktemp("serve-cli")
    args = ["-m", str(TARGET), "-md", str(DRAFT), *LLAMA_SERVER_FLAGS, "--backend", "opencl",
            "--cache-dir", str(folder / "cache"), "--api-key", "s3cret", "-np", "1", "--queue-size", "0",
            "--max-body-bytes", "4096", "--temp", "0"]
    server = ServerProcess(args, folder / "first.log")
    seen = server.wait_ready()
    yield server, seen, args, folder
    server.stop()


@pytest.mark.slow
def test_llama_server_command_compiles_once_and_reports_loading(keyed_server):
    server, seen, args, folder = keyed_server
    assert 503 in seen  # /health said "loading" while the pair compiled
    log = server.log()
    assert "compiling coder-target-q8_0.gguf + coder-dflash-q8_0.gguf for opencl" in log
    assert "-ngl ignored" in log and "-fa ignored" in log
    again = ServerProcess(args, folder / "second.log")  # a second server on the same cache
    try:
        again.wait_ready()
        assert "reusing the compiled artifact" in again.log() and "compiling" not in again.log()
        assert request(again.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2},
                       {"Authorization": "Bearer s3cret"})[0] == 200
    finally:
        again.stop()


@pytest.mark.slow
def test_api_key(keyed_server):
    server = keyed_server[0]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}):
        status, _, got = request(server.port, "POST", "/v1/chat/completions", body, headers)
        assert status == 401 and json.loads(got)["error"]["code"] == "invalid_api_key"
    assert request(server.port, "POST", "/v1/chat/completions", body, {"X-Api-Key": "s3cret"})[0] == 200
    for public in ("/health", "/", "/static/chat.js"):
        assert request(server.port, "GET", public)[0] == 200
    assert request(server.port, "GET", "/metrics")[0] == 401
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert OpenAI(base_url=server.url + "/v1", api_key="s3cret").models.list().data[0].id == "coder-target-q8_0.gguf"


@pytest.mark.slow
def test_past_the_queue_bound_is_503_with_retry_after(keyed_server):
    server = keyed_server[0]
    auth = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}
    busy = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    busy.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 450, "ignore_eos": True,
                                                        "stream": True}), auth)
    stream = busy.getresponse()
    assert stream.status == 200 and stream.readline().startswith(b"data: ")  # it holds the only slot
    status, headers, body = request(server.port, "POST", "/v1/completions", {"prompt": "y", "max_tokens": 2}, auth)
    busy.close()
    assert status == 503 and headers["retry-after"] == "1"
    assert json.loads(body)["error"]["code"] == "queue_full"
    metrics = request(server.port, "GET", "/metrics", headers=auth)[2].decode()
    assert 'dflash:requests_total{outcome="rejected"} 1.0' in metrics


@pytest.mark.slow
def test_chunked_body_past_the_limit_is_413(keyed_server):
    server = keyed_server[0]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    big = json.dumps({"prompt": "x" * 5000}).encode()
    conn.request("POST", "/v1/completions", body=iter([big[:3000], big[3000:]]),
                 headers={"Authorization": "Bearer s3cret", "Transfer-Encoding": "chunked"}, encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large"


@pytest.fixture(scope="module")
def start(demo_artifact, tmp_path_factory):
    """start(*flags): a server on the demo artifact with these flags (stopped at the end)."""
    started = []

    def go(*flags):
        server = ServerProcess(["--artifact", str(demo_artifact), *flags],
                               tmp_path_factory.mktemp("serve-flags") / "server.log")
        started.append(server)
        server.wait_ready()
        return server

    yield go
    for server in started:
        server.stop()


@pytest.mark.slow
def test_generation_defaults_come_from_the_flags(start, engine):
    server = start("--alias", "demo-coder", "-n", "7", "--spec-draft-n-max", "4", "--temp", "0",
                   "--chat-template-kwargs", '{"enable_thinking": false}', "-t", "2", "--metrics", "-ngld", "99")
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["demo-coder"]
    messages = [{"role": "user", "content": "Reverse a string."}]
    r = client.chat.completions.create(model="demo-coder", messages=messages, extra_body={"ignore_eos": True})
    gen = engine.generate(messages=messages, enable_thinking=False, max_tokens=7, ignore_eos=True)
    assert r.usage.completion_tokens == 7 and r.choices[0].message.content == engine.tokenizer.decode(gen.tokens)
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    t, spec = r.model_extra["timings"], r.model_extra["dflash"]
    assert t["draft_n"] <= 4 * spec["rounds"]
    assert "-t ignored" in server.log() and "--metrics ignored" in server.log()


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--no-spec",), ("--spec-draft-n-max", "0")])
def test_no_spec_serves_the_target_alone(start, engine, flags):
    server = start(*flags, "--temp", "0")
    r = OpenAI(base_url=server.url + "/v1", api_key="none").completions.create(
        model="coder-target-q8_0.gguf", prompt="def fib(n):", max_tokens=20, extra_body={"ignore_eos": True})
    gen = engine.generate("def fib(n):", max_tokens=20, ignore_eos=True, speculative=False)
    assert r.choices[0].text == engine.tokenizer.decode(gen.tokens)
    assert "draft_n" not in r.model_extra["timings"] and r.model_extra["dflash"]["mode"] == "target-only"
    assert "target only" in server.log()


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_ir.serve", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, words", [
    ((), "give either --artifact DIR or -m"),
    (("-m", "nowhere.gguf"), "-m: no such file"),
    (("-m", str(TARGET), "-np", "0"), "-np/--parallel: must be at least 1, got 0"),
    (("-m", str(TARGET), "--port", "70000"), "--port: must be in 0..65535"),
    (("-m", str(TARGET), "--top-p", "0"), "--top-p: must be a finite number in (0, 1]"),
    (("-m", str(TARGET), "--chat-template-kwargs", "[1]"), "must be a JSON object"),
    (("-m", str(TARGET), "--chat-template-kwargs", "{bad"), "not valid JSON"),
    (("-m", str(TARGET), "--temp", "-1"), "--temp: must be a finite number in [0, inf)"),
    (("-m", str(TARGET), "--spec-type", "ngram-cache"), "invalid choice: 'ngram-cache'"),
])
def test_bad_flags_say_why(args, words):
    r = run_cli(*args)
    assert r.returncode == 2 and words in r.stderr


def test_an_artifact_keeps_its_context(demo_artifact):
    r = run_cli("--artifact", str(demo_artifact), "-c", "512")
    assert r.returncode == 2 and "an artifact keeps the context it was compiled for" in r.stderr


def test_not_an_artifact(tmp_path):
    r = run_cli("--artifact", str(tmp_path))
    assert r.returncode == 2 and "not a dflash-ir artifact" in r.stderr


def test_a_model_that_fails_to_load_stops_the_server(tmp_path):
    server = ServerProcess(["-m", str(DRAFT), "--backend", "numpy", "--cache-dir", str(tmp_path)], tmp_path / "log")
    assert server.proc.wait(timeout=120) == 1
    assert "dflash-serve: error:" in server.log()
    server.stop()


def test_console_script_is_registered():
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "dflash-serve"]
    assert script.value == "dflash_ir.serve.cli:main"
