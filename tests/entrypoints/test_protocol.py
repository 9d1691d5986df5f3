"""OpenAI requests -> SamplingParams (no server): defaults, renamed fields, and refusals that name the field."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic", reason="the request models need pydantic (pip install 'pagedkv[serve]')")

from pagedkv.engine.request import SamplingParams  # noqa: E402
from pagedkv.entrypoints.openai.protocol import (  # noqa: E402
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
)

CHAT = [{"role": "user", "content": "hi"}]


def test_completion_defaults_are_openais() -> None:
    # OpenAI's completions default to 16 tokens at temperature 1, top_p 1; vLLM's extras to "off".
    params = CompletionRequest(prompt="x").to_sampling_params()
    assert params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)


def test_completion_fields_map_one_to_one() -> None:
    request = CompletionRequest(
        prompt="x",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        n=3,
        stop="\n",
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"65": 2.0},  # JSON's keys are strings
        min_tokens=2,
        logprobs=3,
        include_stop_str_in_output=True,
        ignore_eos=True,
        stop_token_ids=[10],
    )
    expected = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        n=3,
        stop=["\n"],
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={65: 2.0},
        min_tokens=2,
        logprobs=3,
        include_stop_str_in_output=True,
        ignore_eos=True,
        stop_token_ids=[10],
    )
    assert request.to_sampling_params() == expected


def test_top_k_minus_one_keeps_all_tokens() -> None:
    # vLLM spells "no top-k" -1; SamplingParams spells it 0.
    assert CompletionRequest(prompt="x", top_k=-1).to_sampling_params().top_k == 0


def test_chat_max_tokens_defaults_to_the_room_the_prompt_leaves() -> None:
    # As vLLM: no max_tokens in a chat request means up to max_model_len.
    request = ChatCompletionRequest(messages=CHAT)
    assert request.to_sampling_params(num_prompt_tokens=30, max_model_len=100).max_tokens == 70
    # max_completion_tokens is OpenAI's newer name; it wins over the deprecated max_tokens.
    request = ChatCompletionRequest(messages=CHAT, max_tokens=5, max_completion_tokens=9)
    assert request.to_sampling_params(30, 100).max_tokens == 9
    assert ChatCompletionRequest(messages=CHAT, max_tokens=5).to_sampling_params(30, 100).max_tokens == 5


def test_chat_logprobs_are_a_flag_and_a_count() -> None:
    assert ChatCompletionRequest(messages=CHAT).to_sampling_params(3, 100).logprobs is None
    assert ChatCompletionRequest(messages=CHAT, logprobs=True).to_sampling_params(3, 100).logprobs == 0
    request = ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=4)
    assert request.to_sampling_params(3, 100).logprobs == 4
    with pytest.raises(RequestError, match="top_logprobs needs logprobs=true") as info:
        ChatCompletionRequest(messages=CHAT, top_logprobs=4).to_sampling_params(3, 100)
    assert info.value.param == "top_logprobs"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"min_tokens": 20}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
    ],
)
def test_completion_refusals_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(RequestError) as info:
        CompletionRequest(prompt="x", **fields).to_sampling_params()
    assert info.value.param == param and info.value.status == 400
    # The message is SamplingParams' own (or the server's), and names the field too.
    assert param in info.value.message


def test_chat_refusals_use_the_chat_names() -> None:
    # SamplingParams calls them logprobs and max_tokens; a chat request top_logprobs and max_completion_tokens.
    with pytest.raises(RequestError) as info:
        ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=50).to_sampling_params(3, 100)
    assert info.value.param == "top_logprobs"
    with pytest.raises(RequestError) as info:
        ChatCompletionRequest(messages=CHAT, max_completion_tokens=0).to_sampling_params(3, 100)
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(RequestError) as info:
        ChatCompletionRequest(messages=CHAT, tools=[{"type": "function"}]).to_sampling_params(3, 100)
    assert info.value.param == "tools"
    with pytest.raises(RequestError) as info:
        ChatCompletionRequest(messages=CHAT, response_format={"type": "json_object"}).to_sampling_params(3, 100)
    assert info.value.param == "response_format"
    # Plain text is what every answer is anyway.
    assert ChatCompletionRequest(messages=CHAT, response_format={"type": "text"}).to_sampling_params(3, 100)


def test_prompts_of_every_form() -> None:
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    for empty in ("", []):
        with pytest.raises(RequestError, match="prompt is empty") as info:
            CompletionRequest(prompt=empty).prompts()
        assert info.value.param == "prompt"


def test_stream_options_need_a_stream() -> None:
    with pytest.raises(RequestError) as info:
        CompletionRequest(prompt="x", stream_options={"include_usage": True}).to_sampling_params()
    assert info.value.param == "stream_options"
    assert CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True}).include_usage


def test_a_template_that_writes_bos_gets_one_bos() -> None:
    pytest.importorskip("fastapi", reason="the chat endpoint needs fastapi")
    pytest.importorskip("jinja2", reason="chat templates need jinja2")
    from pathlib import Path
    from types import SimpleNamespace

    from pagedkv.entrypoints.openai.serving_chat import ChatTemplate, OpenAIServingChat
    from pagedkv.models.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()  # adds BOS (256) itself, as Llama's tokenizers do
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", {"bos_token": "<s>"}
    )
    engine = SimpleNamespace(get_tokenizer=lambda: tokenizer)
    chat = OpenAIServingChat(engine, "m", 64, None, chat_template=template, model_dir=Path("."))  # type: ignore[arg-type]
    token_ids = chat.prompt_token_ids(chat.prompt(ChatCompletionRequest(messages=CHAT)))
    # Worked by hand: one BOS, then the bytes of "hi" (not BOS + the bytes of "<s>hi").
    assert token_ids == [256, ord("h"), ord("i")]
