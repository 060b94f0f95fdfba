"""The OpenAI API through the official `openai` client against dflash-serve on 127.0.0.1:
streamed == non-streamed == load_compiled(...).generate for the same greedy request; stop
strings, usage, llama-server's timings, reasoning_content, the other endpoints."""
import http.client
import json
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import request

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def expected_text(engine, gen, stop=()) -> str:
    """What a client should see of a generation: no end-of-generation token, cut before the
    first stop string."""
    tokens = gen.tokens[:-1] if gen.stats.stop_reason == "eos" else gen.tokens
    text = engine.tokenizer.decode(tokens)
    cuts = [text.find(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


def expected_split(text: str, prompt_opens_block: bool) -> tuple[str, str]:
    """(reasoning, content) of a chat reply, written out independently of the streaming splitter."""
    if not prompt_opens_block:
        return "", text
    reasoning, _, content = text.partition("</think>")
    return reasoning.lstrip(), content.lstrip()


def streamed_completion(client, **kw):
    chunks = list(client.completions.create(stream=True, **kw))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def streamed_chat(client, **kw):
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    return content, reasoning, chunks


@pytest.mark.parametrize("which", [0, 1])
def test_completion_streamed_equals_plain_equals_engine(client, model_id, engine, prompts, which):
    prompt = prompts[which]
    gen = engine.generate(prompt, max_tokens=40)
    plain = client.completions.create(model=model_id, prompt=prompt, max_tokens=40, temperature=0)
    streamed, chunks = streamed_completion(client, model=model_id, prompt=prompt, max_tokens=40, temperature=0)
    assert plain.choices[0].text == streamed == expected_text(engine, gen)
    assert plain.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "length"
    assert plain.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert plain.usage.completion_tokens == len(gen.tokens) == 40
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 40


def test_chat_streamed_equals_plain_equals_engine(client, model_id, engine):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A queue class."}]
    gen = engine.generate(messages=messages, enable_thinking=False, max_tokens=48)
    plain = client.chat.completions.create(model=model_id, messages=messages, max_tokens=48, temperature=0,
                                           extra_body=NO_THINK)
    content, reasoning, chunks = streamed_chat(client, model=model_id, messages=messages, max_tokens=48,
                                               temperature=0, extra_body=NO_THINK)
    want = expected_split(expected_text(engine, gen), prompt_opens_block=False)
    assert (plain.choices[0].message.content, "") == (content, reasoning)
    assert ((plain.choices[0].message.model_extra or {}).get("reasoning_content") or "", content) == want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert plain.usage.completion_tokens == len(gen.tokens)


def test_thinking_on_returns_reasoning_content(client, model_id, engine):
    messages = [{"role": "user", "content": "Sort a list."}]
    gen = engine.generate(messages=messages, enable_thinking=True, max_tokens=32)
    prompt = engine.chat_template.render(messages, add_generation_prompt=True, enable_thinking=True)
    assert prompt.rstrip().endswith("<think>")  # the Qwen3.5 template opens the block itself
    want_reasoning, want_content = expected_split(expected_text(engine, gen), prompt_opens_block=True)
    plain = client.chat.completions.create(model=model_id, messages=messages, max_tokens=32, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    content, reasoning, _ = streamed_chat(client, model=model_id, messages=messages, max_tokens=32, temperature=0)
    assert plain.choices[0].message.model_extra["reasoning_content"] == reasoning == want_reasoning != ""
    assert plain.choices[0].message.content == content == want_content


def test_stop_strings_end_the_text_before_them(client, model_id, engine, prompts):
    prompt = prompts[0]
    full = expected_text(engine, engine.generate(prompt, max_tokens=60, ignore_eos=True))
    stop = [full[20:24], "never appears \x00"]
    assert full.find(stop[0]) >= 1
    gen = engine.generate(prompt, max_tokens=60, ignore_eos=True, stop=stop)
    plain = client.completions.create(model=model_id, prompt=prompt, max_tokens=60, temperature=0, stop=stop,
                                      extra_body={"ignore_eos": True})
    streamed, chunks = streamed_completion(client, model=model_id, prompt=prompt, max_tokens=60, temperature=0,
                                           stop=stop, extra_body={"ignore_eos": True})
    assert plain.choices[0].text == streamed == full[:full.find(stop[0])] == expected_text(engine, gen, stop)
    assert plain.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens == len(gen.tokens) < 60


def test_stream_usage_and_timings(client, model_id, prompts):
    chunks = list(client.completions.create(model=model_id, prompt=prompts[1], max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    last, final = chunks[-1], chunks[-2]
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        final.model_extra["timings"]["prompt_n"], 30)
    assert all(c.usage is None for c in chunks[:-1])
    check_timings(final.model_extra["timings"], final.model_extra["dflash"], 30)


def check_timings(t: dict, spec: dict, n: int) -> None:
    assert t["predicted_n"] == n and t["prompt_n"] > 0
    for what in ("prompt", "predicted"):
        assert t[f"{what}_ms"] > 0
        assert t[f"{what}_per_second"] == pytest.approx(t[f"{what}_n"] / t[f"{what}_ms"] * 1e3)
        assert t[f"{what}_per_token_ms"] == pytest.approx(t[f"{what}_ms"] / t[f"{what}_n"])
    # the prompt gives the first token, each round its accepted proposals plus a bonus, any
    # other step (a plain decode) one token
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert 1 + spec["rounds"] <= spec["steps"] and n <= t["draft_n_accepted"] + spec["steps"]
    assert spec["tau"] * spec["rounds"] == pytest.approx(t["draft_n_accepted"] + spec["rounds"])
    assert sum(spec["accept_hist"].values()) == spec["rounds"]


def test_plain_responses_carry_timings(client, model_id, prompts):
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompts[2]}],
                                       max_tokens=25, temperature=0, extra_body={"ignore_eos": True, **NO_THINK})
    check_timings(r.model_extra["timings"], r.model_extra["dflash"], 25)


def metric_values(server) -> dict[tuple[str, tuple], float]:
    status, _, body = request(server.port, "GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_metrics_count_a_request(server, client, model_id, prompts):
    before = metric_values(server)
    r = client.completions.create(model=model_id, prompt=prompts[3], max_tokens=33, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metric_values(server)

    def delta(name, **labels):  # a labelled series appears with its first count
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    t, spec = r.model_extra["timings"], r.model_extra["dflash"]
    assert delta("llamacpp:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("llamacpp:tokens_predicted_total") == 33
    assert delta("llamacpp:spec_decode_num_draft_tokens_total") == t["draft_n"]
    assert delta("llamacpp:spec_decode_num_accepted_tokens_total") == t["draft_n_accepted"]
    assert delta("llamacpp:spec_decode_num_drafts_total") == spec["rounds"]
    assert delta("llamacpp:spec_decode_num_accepted_tokens_per_pos_total", position="0") == sum(
        n for accepted, n in spec["accept_hist"].items() if int(accepted) >= 1)
    assert delta("dflash:round_tokens_count") == spec["rounds"]
    assert delta("dflash:round_tokens_sum") == t["draft_n_accepted"] + spec["rounds"]
    assert delta("dflash:requests_total", outcome="finished") == 1
    assert delta("llamacpp:prompt_seconds_total") == pytest.approx(t["prompt_ms"] / 1e3)
    assert delta("llamacpp:tokens_predicted_seconds_total") == pytest.approx(t["predicted_ms"] / 1e3)
    assert delta("llamacpp:n_decode_total") == spec["steps"]
    assert after[("llamacpp:prompt_tokens_seconds", ())] == pytest.approx(
        after[("llamacpp:prompt_tokens_total", ())] / after[("llamacpp:prompt_seconds_total", ())])
    assert after[("llamacpp:requests_processing", ())] == 0 and after[("llamacpp:requests_deferred", ())] == 0
    assert after[("llamacpp:predicted_tokens_seconds", ())] > 0


def test_models_health_slots(server, client, model_id, engine):
    (model,) = client.models.list().data
    assert model.id == "coder-target-q8_0.gguf" and model.owned_by == "dflash-ir"
    assert model.model_extra["meta"]["n_ctx"] == engine.n_ctx
    assert request(server.port, "GET", "/health")[0::2] == (200, b'{"status":"ok"}')
    status, _, body = request(server.port, "GET", "/slots")
    assert status == 200 and [(s["id"], s["is_processing"]) for s in json.loads(body)] == [(0, False), (1, False)]


@pytest.mark.parametrize("path, body", [("/models", None), ("/v1/health", None),
                                        ("/completions", {"prompt": "x", "max_tokens": 2}),
                                        ("/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                               "max_tokens": 2})])
def test_routes_without_v1(server, path, body):
    status, _, got = request(server.port, "POST" if body else "GET", path, body)
    assert status == 200 and json.loads(got)


def test_without_max_tokens_it_runs_until_the_context_is_full(client, model_id, engine, prompts):
    r = client.completions.create(model=model_id, prompt=prompts[0], temperature=0, extra_body={"ignore_eos": True})
    gen = engine.generate(prompts[0], max_tokens=engine.n_ctx, ignore_eos=True)
    assert gen.stats.stop_reason.startswith("context full")
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (len(gen.tokens), "length")
    assert r.choices[0].text == expected_text(engine, gen)


def test_tokenize_and_detokenize_round_trip(server, engine):
    text = "def f(x):\n    return x<|im_end|>"
    status, _, body = request(server.port, "POST", "/tokenize", {"content": text})
    ids = json.loads(body)["tokens"]
    assert status == 200 and ids == engine.tokenizer.encode(text, parse_special=True)
    plain = json.loads(request(server.port, "POST", "/tokenize", {"content": text, "parse_special": False})[2])["tokens"]
    assert plain == engine.tokenizer.encode(text, parse_special=False) != ids
    assert json.loads(request(server.port, "POST", "/detokenize", {"tokens": ids})[2]) == {"content": text}


def test_token_id_prompt(client, model_id, engine, prompts):
    ids = engine.tokenizer.encode(prompts[0])
    r = client.completions.create(model=model_id, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected_text(engine, engine.generate(prompt_ids=ids, max_tokens=12))


def test_sampling_with_a_seed_repeats(client, model_id, prompts):
    kw = dict(model=model_id, prompt=prompts[0], max_tokens=24, temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    assert client.completions.create(**kw).usage.completion_tokens == 24


def wait_idle(server, timeout: float = 5.0) -> float:
    """Seconds until /slots shows no slot processing."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not any(s["is_processing"] for s in json.loads(request(server.port, "GET", "/slots")[2])):
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"a slot is still processing after {timeout}s")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_its_slot(server, prompts, stream):
    before = metric_values(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": prompts[0], "max_tokens": 480, "ignore_eos": True,
                                                        "stream": stream, "temperature": 0}))
    if stream:
        r = conn.getresponse()
        assert r.readline().startswith(b"data: ") and r.readline() == b"\n"  # generating
    else:
        while not any(s["is_processing"] for s in json.loads(request(server.port, "GET", "/slots")[2])):
            time.sleep(0.005)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert wait_idle(server) < 2.0
    after = metric_values(server)
    cancelled = ("dflash:requests_total", (("outcome", "cancelled"),))
    assert after[cancelled] - before[cancelled] == 1
    assert after[("llamacpp:tokens_predicted_total", ())] - before[("llamacpp:tokens_predicted_total", ())] < 480
