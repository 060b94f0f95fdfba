"""Request parsing: server defaults, a request's own fields, and a clear error naming a bad field."""
import pytest

from dflash_ir.runtime.sampling import SamplingParams
from dflash_ir.runtime.stats import GenerationStats
from dflash_ir.serve import openai_api as api

DEFAULTS = api.ServerDefaults("demo", n_ctx=512, max_tokens=-1, sampling=SamplingParams(0.8, 40, 0.95, 0.05, None),
                              template_kwargs={"enable_thinking": False})
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_defaults_come_from_the_server():
    req = api.parse_chat(CHAT, DEFAULTS)
    assert req.sampling == DEFAULTS.sampling
    assert req.max_tokens == 512  # -n -1: until the context is full
    assert req.template_kwargs == {"enable_thinking": False}
    assert (req.stream, req.include_usage, req.stop, req.ignore_eos) == (False, False, [], False)


def test_n_predict_zero_reads_the_prompt_only():
    zero = api.ServerDefaults("demo", n_ctx=512, max_tokens=0, sampling=SamplingParams())
    assert api.parse_completion({"prompt": "x"}, zero).max_tokens == 0


def test_request_fields_win():
    req = api.parse_chat({**CHAT, "model": "demo", "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1,
                          "seed": 7, "max_completion_tokens": 9, "stop": "x", "stream": True,
                          "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": True},
                          "ignore_eos": True, "user": "ignored extra"}, DEFAULTS)
    assert req.sampling == SamplingParams(0.0, 3, 0.5, 0.1, 7)
    assert (req.max_tokens, req.stop, req.stream, req.include_usage, req.ignore_eos) == (9, ["x"], True, True, True)
    assert req.template_kwargs == {"enable_thinking": True}


def test_message_content_parts_and_roles():
    req = api.parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]}, DEFAULTS)
    assert [(m["role"], m["content"]) for m in req.messages] == [("system", "be brief"), ("user", "ab")]


def test_completion_prompt_forms():
    assert api.parse_completion({"prompt": "x"}, DEFAULTS).prompt == "x"
    assert api.parse_completion({"prompt": ["x"]}, DEFAULTS).prompt == "x"
    assert api.parse_completion({"prompt": [1, 2, 3]}, DEFAULTS).prompt == [1, 2, 3]


@pytest.mark.parametrize("body, param, status", [
    ({**CHAT, "max_tokens": "10"}, "max_tokens", 400),
    ({**CHAT, "max_tokens": -1}, "max_tokens", 400),
    ({**CHAT, "max_tokens": 0}, "max_tokens", 400),
    ({**CHAT, "max_tokens": True}, "max_tokens", 400),
    ({**CHAT, "temperature": "hot"}, "temperature", 400),
    ({**CHAT, "temperature": -0.5}, "temperature", 400),
    ({**CHAT, "top_p": 0}, "top_p", 400),
    ({**CHAT, "top_k": -1}, "top_k", 400),
    ({**CHAT, "seed": -3}, "seed", 400),
    ({**CHAT, "n": 2}, "n", 400),
    ({**CHAT, "stream": "yes"}, "stream", 400),
    ({**CHAT, "stop": ["a", 3]}, "stop", 400),
    ({**CHAT, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage", 400),
    ({**CHAT, "chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking", 400),
    ({**CHAT, "model": "gpt-4o"}, "model", 404),
    ({**CHAT, "logprobs": True}, "logprobs", 400),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools", 400),
    ({**CHAT, "presence_penalty": 0.5}, "presence_penalty", 400),
    ({"messages": "hi"}, "messages", 400),
    ({"messages": []}, "messages", 400),
    ({}, "messages", 400),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", 400),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", 400),
    ({"messages": ["hi"]}, "messages[0]", 400),
])
def test_bad_chat_field_is_named(body, param, status):
    with pytest.raises(api.RequestError) as e:
        api.parse_chat(body, DEFAULTS)
    assert (e.value.param, e.value.status) == (param, status)
    assert e.value.body()["error"]["param"] == param
    assert param.split(".")[0].split("[")[0] in e.value.message


@pytest.mark.parametrize("body, param", [({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                                         ({"prompt": [1, "a"]}, "prompt"), ({"prompt": 3}, "prompt"),
                                         ({"prompt": "x", "echo": True}, "echo"), ([1, 2], None)])
def test_bad_completion_field_is_named(body, param):
    with pytest.raises(api.RequestError) as e:
        api.parse_completion(body, DEFAULTS)
    assert e.value.param == param and e.value.status == 400


def test_timings_have_llama_server_fields():
    stats = GenerationStats(prompt_tokens=10, generated_tokens=20, drafted=45, accepted=15)
    t = api.timings(stats, 0.5, 2.0)
    assert t == {"prompt_n": 10, "prompt_ms": 500.0, "prompt_per_token_ms": 50.0, "prompt_per_second": 20.0,
                 "predicted_n": 20, "predicted_ms": 2000.0, "predicted_per_token_ms": 100.0,
                 "predicted_per_second": 10.0, "draft_n": 45, "draft_n_accepted": 15}
    assert "draft_n" not in api.timings(GenerationStats(mode="target-only", prompt_tokens=1), 0.1, 0.0)
