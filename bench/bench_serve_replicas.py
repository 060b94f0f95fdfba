"""dflash-serve replicas: throughput and request latency with 1 and 2 Ray Serve replicas
(and the plain server beside them) on the demo pair, OpenCL (PoCL on the CPU)

Each server has 2 slots per replica and gets REQUESTS completions of TOKENS tokens (greedy,
ignore_eos) from CLIENTS concurrent clients after a warm-up; tokens/s is all completion tokens
over the run's wall time, latency is per request (send to last byte).

    python -m pytest bench/bench_serve_replicas.py -q -s -p no:cacheprovider
"""
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dflash_ir import compile_pair
from dflash_ir.serve.loadgen import percentile, run

from common import ready_backend

DEMO = Path(__file__).resolve().parents[1] / "demo"
REQUESTS, CLIENTS, TOKENS, WARM = 64, 8, 32, 16
HEADER = (f"{'server':22s} {'requests':>8s} {'tok/s':>7s} {'req/s':>6s} {'p50 s':>6s} {'p90 s':>6s} {'p99 s':>6s}"
          f"   ({CLIENTS} clients, {TOKENS} tokens each, 2 slots per engine unless said)")
SERVERS = {"plain": [], "plain, 4 slots": ["-np", "4"], "ray, 1 replica": ["--ray", "--replicas", "1"],
           "ray, 2 replicas": ["--ray", "--replicas", "2"]}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    ready_backend("opencl")
    out = tmp_path_factory.mktemp("bench-serve") / "demo-opencl"
    compile_pair(DEMO / "coder-target-q8_0.gguf", DEMO / "coder-dflash-q8_0.gguf", out=out, backend="opencl",
                 n_ctx=512)
    return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def measure(artifact: Path, flags: list[str], log: Path) -> tuple[list[float], float, int]:
    """(latencies, wall seconds, completion tokens) of the measured run on a fresh server."""
    port = _port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "dflash_ir.serve", "--artifact", str(artifact), "-np", "2",
                                   "--temp", "0", "--port", str(port), *flags], stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + 600
            while not (_healthy(url) and "dflash-serve: ready:" in log.read_text()):  # every replica is up
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            body = {"prompt": "def fib(n):", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
            run(url, [body] * WARM, CLIENTS)  # every replica builds its kernels on its first runs
            results, seconds = run(url, [body] * REQUESTS, CLIENTS)
        finally:
            server.terminate()
            server.wait(timeout=60)
    errors = [r.error for r in results if r.error]
    assert not errors, errors[:3]
    return [r.seconds for r in results], seconds, sum(r.completion_tokens for r in results)


@pytest.mark.parametrize("name", list(SERVERS))
def test_serve_replicas(benchmark, table, artifact, name, tmp_path):
    if SERVERS[name]:
        pytest.importorskip("ray", reason="dflash-serve --ray needs the 'ray' extra (pip install 'dflash-ir[ray]')")
    latencies, seconds, tokens = benchmark.pedantic(measure, args=(artifact, SERVERS[name], tmp_path / "server.log"),
                                                    rounds=1, iterations=1)
    assert tokens == REQUESTS * TOKENS
    p50, p90, p99 = (percentile(latencies, p) for p in (50, 90, 99))
    table(HEADER, f"{name:22s} {REQUESTS:8d} {tokens / seconds:7.1f} {REQUESTS / seconds:6.2f} "
                  f"{p50:6.2f} {p90:6.2f} {p99:6.2f}")
