"""Chat template rendering: HF/llama.cpp --jinja environment and the Qwen3.5 ChatML output."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from jinja2.exceptions import SecurityError

from dflash_ir.models.chat_template import ChatTemplate, ChatTemplateError
from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.models.tokenizer import Tokenizer

TARGET = "dense/gguf/dense-target-f16.gguf"
HI = [{"role": "user", "content": "Hi"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

# ---- the Jinja environment (inline templates, no fixtures) ------------------------


def test_raise_exception_is_a_clear_error():
    template = ChatTemplate("{% if not messages %}{{ raise_exception('No messages provided.') }}{% endif %}ok")
    assert template.render(HI) == "ok"
    with pytest.raises(ChatTemplateError, match="chat template error: No messages provided."):
        template.render([])


def test_tojson_is_hf_compatible():
    template = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}")
    x = {"b": "é<>&'", "a": [1, None, True]}
    compact, indented = template.render(HI, x=x).split("|")
    assert compact == '{"b": "é<>&\'", "a": [1, null, true]}'  # no HTML escaping, no key sorting
    assert indented == json.dumps(x, ensure_ascii=False, indent=2)


def test_strftime_now_and_variables():
    template = ChatTemplate("{{ strftime_now('%Y') }} {{ bos_token }}{{ eos_token }} {{ enable_thinking }} {{ mine }}")
    year = datetime.now().strftime("%Y")
    assert template.render(HI, mine=7) == f"{year}  True 7"
    assert ChatTemplate("{{ bos_token }}{{ eos_token }}", bos_token="<s>", eos_token="</s>").render(HI) == "<s></s>"


def test_trim_blocks_lstrip_blocks_and_loopcontrols():
    template = ChatTemplate(
        "{% for m in messages %}\n"
        "    {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "{{ m.content }};\n"
        "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
    )
    messages = [{"role": r, "content": c} for r, c in (("system", "s"), ("user", "a"), ("user", "b"), ("user", "c"))]
    assert template.render(messages) == "a;\nb;\n"


def test_sandboxed():
    with pytest.raises(SecurityError):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render(HI)


def test_missing_template_is_a_clear_error():
    with pytest.raises(ValueError, match="no tokenizer.chat_template"):
        ChatTemplate.from_metadata({"tokenizer.ggml.model": "gpt2"})


# ---- the Qwen3.5 template from the oracle GGUF ------------------------------------


@pytest.fixture(scope="module")
def metadata(oracle_gguf):
    with open_gguf(oracle_gguf(TARGET)) as gguf:
        return gguf.metadata


@pytest.fixture(scope="module")
def qwen35(metadata):
    return ChatTemplate.from_metadata(metadata)


@pytest.fixture(scope="module")
def tokenizer(metadata):
    return Tokenizer.from_metadata(metadata, source=TARGET)


@pytest.mark.oracle
def test_template_is_the_fixture_template(qwen35, oracle_dir):
    assert qwen35.source == (oracle_dir.parent / "tokenizer" / "chat_template.jinja").read_text()
    assert (qwen35.bos_token, qwen35.eos_token) == ("", "<|im_end|>")


@pytest.mark.oracle
def test_single_user_turn(qwen35):
    assert qwen35.render(HI) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert (
        qwen35.render(HI, enable_thinking=False)
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert qwen35.render(HI, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


@pytest.mark.oracle
def test_system_prompt(qwen35):
    messages = [{"role": "system", "content": "Be brief.\n"}, *HI]
    assert qwen35.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


@pytest.mark.oracle
def test_multi_turn_with_reasoning(qwen35):
    answer = {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"}
    # Before the last user query the reasoning is dropped ...
    assert qwen35.render([*HI, answer, {"role": "user", "content": "Bye"}], enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # ... after it, it is kept; reasoning_content is the same as inline <think>.
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello!<|im_end|>\n"
    assert qwen35.render([*HI, answer], add_generation_prompt=False) == expected
    split = {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}
    assert qwen35.render([*HI, split], add_generation_prompt=False) == expected


@pytest.mark.oracle
def test_tool_call_round(qwen35):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Sunny, 20°C"},
    ]
    text = qwen35.render(messages, tools=[WEATHER_TOOL])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + json.dumps(WEATHER_TOOL, ensure_ascii=False)
        + "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:"
    )
    assert system.endswith("</IMPORTANT>")
    assert rest == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nSunny, 20°C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    # Arguments given as an object render the same; the caller's messages are not modified.
    as_object = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert qwen35.render([messages[0], {**messages[1], "tool_calls": [as_object]}, messages[2]], tools=[WEATHER_TOOL]) == text
    assert messages[1]["tool_calls"][0] is call and isinstance(call["function"]["arguments"], str)


@pytest.mark.oracle
def test_template_errors(qwen35):
    with pytest.raises(ChatTemplateError, match="No user query found in messages."):
        qwen35.render([{"role": "system", "content": "You are helpful."}])
    with pytest.raises(ChatTemplateError, match="No messages provided."):
        qwen35.render([])
    with pytest.raises(ChatTemplateError, match="System message must be at the beginning."):
        qwen35.render([*HI, {"role": "system", "content": "late"}])


@pytest.mark.oracle
def test_oracle_chat_prompt(qwen35, tokenizer, oracle_dir):
    prompts = json.loads((oracle_dir / "prompts.json").read_text())
    chats = [p for p in prompts if "messages" in p]
    assert chats
    for p in chats:
        text = qwen35.render(p["messages"], enable_thinking=p["enable_thinking"])
        assert text == p["text"]
        assert tokenizer.encode(text) == p["ids"]


@pytest.mark.oracle
def test_tokenizer_check_example(qwen35, tokenizer, oracle_dir):
    check = json.loads((oracle_dir.parent / "tokenizer" / "tokenizer_check.json").read_text())["chat_template"]
    assert qwen35.render(HI) == check["thinking"]
    text = qwen35.render(HI, enable_thinking=False)
    assert text == check["no_thinking"]
    assert tokenizer.encode(text) == check["no_thinking_ids"]
    assert check["no_thinking_ids"][-7:] == [248045, 74455, 198, 248068, 271, 248069, 271]
