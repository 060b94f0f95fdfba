"""dflash-serve fixtures: the demo pair compiled once per session for OpenCL (PoCL on a CPU),
an engine on it in this process (the single-client reference), and servers started as
real processes on 127.0.0.1."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_ir import compile_pair, load_compiled

DEMO = Path(__file__).resolve().parents[2] / "demo"
TARGET, DRAFT = DEMO / "coder-target-q8_0.gguf", DEMO / "coder-dflash-q8_0.gguf"
N_CTX = 512


def _opencl_or_skip() -> str:
    from dflash_ir.backends.base import get_backend

    reason = get_backend("opencl").unavailable_reason()
    if reason:
        pytest.skip(f"dflash-serve tests run the demo pair on OpenCL (PoCL on a CPU; make setup installs it): {reason}")
    return "opencl"


@pytest.fixture(scope="session")
def demo_artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve") / "demo-opencl"
    compile_pair(TARGET, DRAFT, out=out, backend=_opencl_or_skip(), n_ctx=N_CTX)
    return out


@pytest.fixture(scope="session")
def engine(demo_artifact):
    """The single-client reference: load_compiled(...).generate, as a user would call it, with
    n_max proposals every round: an engine that chooses its draft length by measured costs may
    decode instead (on PoCL it mostly does), which would leave no drafts to compare."""
    engine = load_compiled(demo_artifact)
    if getattr(engine, "controller", None) is not None:
        engine.costs = None
    return engine


@pytest.fixture(scope="session")
def prompts(engine) -> list[str]:
    """Code prompts (the demo pair's held-out ones and a few more) whose greedy continuations
    all differ from each other, so a reply given to the wrong client shows."""
    candidates = [p["text"] for p in json.loads((DEMO / "prompts.json").read_text())]
    candidates += ["def fib(n):", "class Foo:\n", "x = [1, 2", "import os\n"]
    seen, chosen = set(), []
    for text in candidates:
        out = tuple(engine.generate(text, max_tokens=48, ignore_eos=True).tokens)
        if out not in seen:
            seen.add(out)
            chosen.append(text)
    assert len(chosen) >= 4, "the demo pair gives fewer than 4 distinct continuations"
    return chosen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m dflash_ir.serve ARGS --port P` with its output in `log_path`."""

    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash_ir.serve", *args, "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self, path: str = "/health") -> int | None:
        """HTTP status of GET path, None while nothing listens."""
        try:
            return request(self.port, "GET", path)[0]
        except OSError:
            return None

    def wait_ready(self, timeout: float = 300) -> list[int | None]:
        """Polls /health until 200; returns the statuses seen on the way."""
        seen: list[int | None] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"dflash-serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            status = self.status()
            seen.append(status)
            if status == 200:
                return seen
            time.sleep(0.05)
        pytest.fail(f"dflash-serve not healthy after {timeout}s:\n{self.log()[-3000:]}")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()


def request(port: int, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
            timeout: float = 60) -> tuple[int, dict, bytes]:
    """One raw HTTP request: (status, headers, body bytes)."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.fixture(scope="session")
def server(demo_artifact, tmp_path_factory):
    """The shared server: demo artifact, 2 slots, greedy by default."""
    s = ServerProcess(["--artifact", str(demo_artifact), "-np", "2", "--temp", "0"],
                      tmp_path_factory.mktemp("serve-log") / "server.log")
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_id(client) -> str:
    return client.models.list().data[0].id
