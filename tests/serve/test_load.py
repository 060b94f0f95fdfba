"""Load on loopback: 200 requests from 8 concurrent clients on 2 slots, streaming and not,
some clients leaving mid-stream. Every completed reply equals its single-client greedy result
(none lost, none mixed up), memory stays flat, the server is healthy at the end."""
import json
import time

import pytest

from dflash_ir.serve.loadgen import run

from .conftest import ServerProcess, request
from .test_api import expected_text, metric_values, wait_idle

LENGTHS = (8, 16, 24)
REQUESTS, CLIENTS = 200, 8
# resident memory the server may gain: over the second half of the run, when every program
# has run (a program's first run builds its kernels, once per process), and over all of it
MEMORY_SLACK, MEMORY_SLACK_FIRST_USE = 16 << 20, 48 << 20


def bodies_for(prompts, count: int) -> tuple[list[dict], dict[int, int]]:
    """Request i: prompt i mod P, length i mod 3, every other one streamed; every 10th
    streamed one is long and its client leaves after the first chunk."""
    bodies, leave = [], {}
    for i in range(count):
        body = {"prompt": prompts[i % len(prompts)], "max_tokens": LENGTHS[i % len(LENGTHS)], "stream": i % 2 == 0}
        if i % 20 == 0:
            body.update(max_tokens=400, ignore_eos=True)
            leave[i] = 1
        bodies.append(body)
    return bodies, leave


@pytest.mark.slow
def test_load(demo_artifact, engine, prompts, tmp_path):
    want = {}
    for p in prompts:
        for n in LENGTHS:
            gen = engine.generate(p, max_tokens=n)
            finish = "stop" if gen.stats.stop_reason == "eos" else "length"
            want[p, n] = (expected_text(engine, gen), len(gen.tokens), finish)
    server = ServerProcess(["--artifact", str(demo_artifact), "-np", "2", "--temp", "0", "--queue-size", "16"],
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        warm, leave = bodies_for(prompts, 40)
        run(server.url, warm, CLIENTS, cancel_after=leave)
        wait_idle(server)
        rss_before, metrics_before = server.rss_bytes(), metric_values(server)

        bodies, leave = bodies_for(prompts, REQUESTS)
        half = REQUESTS // 2
        start = time.monotonic()
        results, seconds = run(server.url, bodies[:half], CLIENTS, cancel_after={i: n for i, n in leave.items()
                                                                                if i < half})
        wait_idle(server)
        rss_half = server.rss_bytes()
        leave_later = {i - half: n for i, n in leave.items() if i >= half}
        rest, more_seconds = run(server.url, bodies[half:], CLIENTS, cancel_after=leave_later)
        results, seconds = results + rest, seconds + more_seconds
        assert time.monotonic() - start < 120
        wait_idle(server)
        rss_after, metrics_after = server.rss_bytes(), metric_values(server)

        assert [r.error for r in results] == [None] * REQUESTS
        completed = [(b, r) for i, (b, r) in enumerate(zip(bodies, results)) if i not in leave]
        assert all((r.text, r.completion_tokens, r.finish_reason) == want[b["prompt"], b["max_tokens"]]
                   for b, r in completed)
        assert all(r.cancelled for i, r in enumerate(results) if i in leave)

        def delta(outcome):
            key = ("dflash:requests_total", (("outcome", outcome),))
            return metrics_after[key] - metrics_before[key]

        assert delta("finished") + delta("cancelled") == REQUESTS  # each request counted once, none lost
        assert delta("cancelled") >= 1 and delta("failed") == delta("rejected") == 0
        assert rss_after - rss_half < MEMORY_SLACK and rss_after - rss_before < MEMORY_SLACK_FIRST_USE, (
            rss_before, rss_half, rss_after)
        passes, blocks = (metrics_after[name, ()] - metrics_before[name, ()]
                          for name in ("dflash:verify_passes_total", "dflash:verify_blocks_total"))
        assert passes < blocks  # the two slots' blocks shared target passes (batched verify, on by default)
        assert request(server.port, "GET", "/health")[0] == 200
        assert all(not s["is_processing"] for s in json.loads(request(server.port, "GET", "/slots")[2]))
        print(f"\nload: {REQUESTS} requests, {CLIENTS} clients, 2 slots: {seconds:.1f}s, "
              f"{sum(r.completion_tokens for r in results) / seconds:.0f} tokens/s aggregate, "
              f"{delta('cancelled'):.0f} cancelled, {blocks:.0f} blocks verified in {passes:.0f} passes, RSS {rss_before >> 20} -> {rss_half >> 20} -> {rss_after >> 20} MiB")
    finally:
        server.stop()
