"""Bad requests get a 4xx JSON error in OpenAI's shape naming the problem, and the server
keeps serving."""
import http.client
import json

import openai
import pytest

from .conftest import request
from .test_api import metric_values

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
JSON = {"Content-Type": "application/json"}


def still_serving(server) -> None:
    status, _, body = request(server.port, "POST", COMPLETION, {"prompt": "def f():", "max_tokens": 3})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3


def error_of(status: int, body: bytes, want_status: int, param=None) -> dict:
    assert status == want_status, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    return error


@pytest.mark.parametrize("path, body, status, param, words", [
    (COMPLETION, b'{"prompt": "x", "max_tokens": ', 400, None, "not valid JSON"),
    (COMPLETION, b'{"prompt": "caf\xe9"}', 400, None, "not valid UTF-8"),
    (COMPLETION, b'{"prompt": "x", "temperature": NaN}', 400, None, "NaN"),
    (COMPLETION, b'["x"]', 400, None, "JSON object"),
    (COMPLETION, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens", "an integer"),
    (COMPLETION, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens", "at least 1"),
    (COMPLETION, {"prompt": "x", "n": 2}, 400, "n", "must be 1"),
    (COMPLETION, {"prompt": ["x", "y"]}, 400, "prompt", "one prompt"),
    (COMPLETION, {"prompt": [5, 999999]}, 400, "prompt", "999999"),
    (COMPLETION, {"prompt": "x", "model": "gpt-4"}, 404, "model", "gpt-4"),
    (COMPLETION, {"prompt": "x", "logprobs": 3}, 400, "logprobs", "not supported"),
    (COMPLETION, {"prompt": "def f():\n" * 300}, 400, "prompt", "context"),
    (CHAT, {"messages": "hi"}, 400, "messages", "an array"),
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream", "a boolean"),
    (CHAT, {"messages": MSG, "temperature": "warm"}, 400, "temperature", "a number"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "robot"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages", "context"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens", "integers"),
    ("/tokenize", {"text": "x"}, 400, "content", "required"),
])
def test_bad_request_is_a_json_error_and_the_server_goes_on(server, path, body, status, param, words):
    invalid = ("dflash:requests_total", (("outcome", "invalid"),))
    before = metric_values(server)[invalid]
    got_status, _, got = request(server.port, "POST", path, body, JSON)
    error = error_of(got_status, got, status, param)
    assert words in error["message"]
    assert metric_values(server)[invalid] == before + 1
    still_serving(server)


def test_prompt_longer_than_context_names_both_sizes(server, engine):
    prompt = "def f():\n" * 300
    n = len(engine.tokenizer.encode(prompt))
    status, _, body = request(server.port, "POST", COMPLETION, {"prompt": prompt})
    error = error_of(status, body, 400, "prompt")
    assert error["code"] == "context_length_exceeded" and f"{n} tokens" in error["message"]
    assert f"{engine.n_ctx}" in error["message"]


def test_oversized_body_is_refused_before_it_is_sent(server):
    """Content-Length past --max-body-bytes: 413 at once, without the server reading the body."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", COMPLETION)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(64 << 20))
    conn.endheaders()
    r = conn.getresponse()
    error = error_of(r.status, r.read(), 413)
    conn.close()
    assert error["code"] == "request_too_large"
    still_serving(server)


def test_unknown_route_and_wrong_method_are_json(server):
    error_of(*request(server.port, "GET", "/v1/nothing")[0::2], 404)
    error_of(*request(server.port, "GET", COMPLETION)[0::2], 405)
    still_serving(server)


def test_openai_client_sees_the_error(client, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=MSG, n=3)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MSG)
    assert e.value.body["code"] == "model_not_found"
