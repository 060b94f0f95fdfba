"""Concurrent clients against a running dflash-serve: aggregate tokens/s and request latency
percentiles with 1, 2, 4 ... clients, and the request driver of the load test.

    python -m dflash_ir.serve.loadgen --url http://127.0.0.1:8080 --clients 1,2,4 --requests 8 -n 64

Each client sends its requests one after another (a completion with `ignore_eos`, so every
request generates exactly -n tokens); the aggregate rate is all completion tokens over the
wall time of the whole run; a request's latency is from sending it to its last byte. Plain HTTP (http.client), no other dependency.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Result:
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    cancelled: bool = False
    error: str | None = None
    seconds: float = 0.0  # latency: request sent to response read


def percentile(values: list[float], p: float) -> float:
    """The nearest-rank p-th percentile (p in (0, 100]): the smallest value with at least p%
    of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def complete(url: str, body: dict, *, cancel_after: int | None = None, api_key: str | None = None,
             timeout: float = 300) -> Result:
    """POST /v1/completions; with body["stream"], read the SSE stream, and with `cancel_after`
    close the connection after that many text chunks (a client that goes away)."""
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        r = conn.getresponse()
        if r.status != 200:
            return Result(error=f"HTTP {r.status}: {r.read()[:200]!r}")
        if not body.get("stream"):
            reply = json.loads(r.read())
            return Result(reply["choices"][0]["text"], reply["usage"]["completion_tokens"],
                          reply["choices"][0]["finish_reason"])
        return _read_stream(r, cancel_after)
    finally:
        conn.close()


def _read_stream(r, cancel_after: int | None) -> Result:
    result, chunks = Result(), 0
    for line in r:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            return Result(error=event["error"]["message"])
        choice = event["choices"][0]
        result.text += choice["text"]
        result.finish_reason = choice["finish_reason"] or result.finish_reason
        if "timings" in event:
            result.completion_tokens = event["timings"]["predicted_n"]
        chunks += 1
        if cancel_after is not None and chunks >= cancel_after:
            result.cancelled = True
            break
    return result


def run(url: str, bodies: list[dict], clients: int, *, cancel_after: dict[int, int] | None = None,
        api_key: str | None = None) -> tuple[list[Result], float]:
    """Send `bodies` from `clients` concurrent clients; (results in order, wall seconds)."""
    cancel_after = cancel_after or {}

    def timed(i: int) -> Result:
        sent = time.perf_counter()
        result = complete(url, bodies[i], cancel_after=cancel_after.get(i), api_key=api_key)
        result.seconds = time.perf_counter() - sent
        return result

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(timed, range(len(bodies))))
    return results, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_ir.serve.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--clients", default="1,2,4", help="comma-separated client counts (default 1,2,4)")
    p.add_argument("--requests", type=int, default=8, help="requests per client (default 8)")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("-p", "--prompt", default="def fib(n):")
    p.add_argument("--api-key")
    args = p.parse_args(argv)
    body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    run(args.url, [body], 1, api_key=args.api_key)  # warm-up
    print(f"{'clients':>7} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} "
          f"{'p50 s':>7} {'p90 s':>7} {'p99 s':>7}")
    for clients in (int(c) for c in args.clients.split(",")):
        results, seconds = run(args.url, [body] * (clients * args.requests), clients, api_key=args.api_key)
        failed = [r.error for r in results if r.error]
        if failed:
            print(f"{clients} clients: {len(failed)} requests failed, e.g. {failed[0]}", file=sys.stderr)
            return 1
        tokens = sum(r.completion_tokens for r in results)
        latencies = [r.seconds for r in results]
        print(f"{clients:>7} {len(results):>8} {tokens:>7} {seconds:>8.2f} {tokens / seconds:>9.1f} "
              + " ".join(f"{percentile(latencies, p):>7.2f}" for p in (50, 90, 99)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
