"""`pagedkv serve` against the real openai client: the same tokens as `LLM.generate`, streamed and
not, n, stop, logprobs, chat with the template, bad requests, a client that goes away, and load."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.request import CompletionOutput
from tests.entrypoints.conftest import MODEL, Server, needs_server_packages

needs_server_packages()

import httpx  # noqa: E402
import openai  # noqa: E402

PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def offline(llm: LLM, prompt: str, **params: object) -> list[CompletionOutput]:
    """What the offline engine answers: the reference of every server answer below."""
    return llm.generate(prompt, SamplingParams(**params))[0].outputs  # type: ignore[arg-type]


def streamed(client: openai.OpenAI, **request: object) -> tuple[dict[int, str], dict[int, str | None]]:
    """A streamed completion's text and finish reason per choice, its chunks joined."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in client.completions.create(model=MODEL, stream=True, **request):  # type: ignore[call-overload]
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    return texts, reasons


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 1234}], ids=["greedy", "seeded"]
)
def test_completion_equals_generate(server: Server, client: openai.OpenAI, llm: LLM, sampling: dict) -> None:
    expected = offline(llm, PROMPT, max_tokens=12, **sampling)[0]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, extra_body={"return_token_ids": True}, **sampling
    )
    (choice,) = response.choices
    assert choice.text == expected.text
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert choice.finish_reason == expected.finish_reason == "length"
    prompt_tokens = len(llm.get_tokenizer().encode(PROMPT))
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 12)
    # Token ids as the prompt give the same answer.
    by_ids = client.completions.create(
        model=MODEL, prompt=llm.get_tokenizer().encode(PROMPT), max_tokens=12, **sampling
    )
    assert by_ids.choices[0].text == expected.text


def test_stream_equals_whole(client: openai.OpenAI, llm: LLM) -> None:
    expected = offline(llm, PROMPT, max_tokens=20, temperature=0.7, seed=5)[0]
    texts, reasons = streamed(client, prompt=PROMPT, max_tokens=20, temperature=0.7, seed=5)
    assert texts == {0: expected.text} and reasons == {0: "length"}
    # With include_usage, a last chunk without choices counts the tokens.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=20, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_batch_of_prompts(client: openai.OpenAI, llm: LLM) -> None:
    prompts = [PROMPT, "The list type", "import os"]
    expected = [offline(llm, p, max_tokens=6, temperature=0)[0].text for p in prompts]
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == expected
    texts, _ = streamed(client, prompt=prompts, max_tokens=6, temperature=0)
    assert texts == dict(enumerate(expected))


def test_n_choices(client: openai.OpenAI, llm: LLM) -> None:
    expected = [c.text for c in offline(llm, "The list type", max_tokens=10, temperature=1.0, seed=3, n=3)]
    assert len(set(expected)) > 1  # the seed gives the choices different draws: a real test of n
    response = client.completions.create(
        model=MODEL, prompt="The list type", max_tokens=10, temperature=1.0, seed=3, n=3
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == expected
    assert response.usage is not None and response.usage.completion_tokens == 30
    texts, reasons = streamed(client, prompt="The list type", max_tokens=10, temperature=1.0, seed=3, n=3)
    assert texts == dict(enumerate(expected)) and reasons == dict.fromkeys(range(3), "length")


def test_stop_string(client: openai.OpenAI, llm: LLM) -> None:
    whole = offline(llm, "The list type", max_tokens=30, temperature=0)[0].text
    stop = "***"
    assert stop in whole  # the greedy text holds it: the reference is the text before it
    if stop in offline(llm, "The list type", max_tokens=30, temperature=0, stop=[stop])[0].text:
        pytest.skip("stop strings: not implemented yet in the engine")
    expected = whole[: whole.index(stop)]
    response = client.completions.create(model=MODEL, prompt="The list type", max_tokens=30, temperature=0, stop=stop)
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected, "stop", stop)
    texts, reasons = streamed(client, prompt="The list type", max_tokens=30, temperature=0, stop=[stop])
    assert texts == {0: expected} and reasons == {0: "stop"}


def test_logprobs(client: openai.OpenAI, llm: LLM) -> None:
    expected = offline(llm, PROMPT, max_tokens=6, temperature=0, logprobs=3)[0]
    assert expected.logprobs is not None
    tokenizer = llm.get_tokenizer()
    logprobs = (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
        .choices[0]
        .logprobs
    )
    assert logprobs is not None
    assert logprobs.tokens == [tokenizer.decode([t]) for t in expected.token_ids]
    assert logprobs.token_logprobs == pytest.approx([lp[t] for t, lp in zip(expected.token_ids, expected.logprobs)])
    for top, ref in zip(logprobs.top_logprobs or [], expected.logprobs):
        best = sorted(ref.items(), key=lambda item: -item[1])[:3]
        assert list(top.values()) == pytest.approx([lp for _, lp in best])  # the 3 likeliest, likeliest first
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(6)]


def test_chat_uses_the_template(client: openai.OpenAI, llm: LLM) -> None:
    transformers = pytest.importorskip("transformers", reason="the chat template's reference rendering")
    from pagedkv.models.loader import checkpoint_dir

    messages = [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "What is a list?"}]
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint_dir(MODEL))
    prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = offline(llm, prompt, max_tokens=10, temperature=0, logprobs=2)[0]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    choice = response.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", expected.text)
    assert response.usage is not None and response.usage.prompt_tokens == len(llm.get_tokenizer().encode(prompt))
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        logprobs=True,
        top_logprobs=2,  # type: ignore[arg-type]
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    sampled = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert expected.logprobs is not None
    assert [e.logprob for e in sampled] == pytest.approx(
        [lp[t] for t, lp in zip(expected.token_ids, expected.logprobs)]
    )
    assert all(len(e.top_logprobs) == 2 for e in sampled)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        ({"prompt": PROMPT, "temperature": -1}, "temperature"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),  # a wrong type: pydantic's refusal
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "top_p": 1.5}, "top_p"),
        ({"prompt": PROMPT, "logprobs": 99}, "logprobs"),
        ({"prompt": [1, 2, 99999]}, "prompt"),  # a token id beyond the vocabulary: the engine's refusal
        ({"max_tokens": 3}, "prompt"),  # missing
        ({"prompt": PROMPT, "logit_bias": {"50256": -100}}, "logit_bias"),  # beyond the vocabulary: the engine's
        ({"prompt": PROMPT, "stop_token_ids": [50256]}, "stop_token_ids"),
    ],
)
def test_bad_completion_requests(client: openai.OpenAI, request_body: dict, param: str) -> None:
    body = {"model": MODEL, **request_body}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.post("/completions", cast_to=object, body={**body, "stream": stream})
        error = info.value.body
        assert isinstance(error, dict) and error["param"] == param and error["type"] == "invalid_request_error"
        assert param in error["message"].lower() and "Traceback" not in error["message"]


def test_prompt_that_is_not_utf8(server: Server) -> None:
    # JSON may escape a lone surrogate, which no UTF-8 tokenizer can encode (the openai client cannot
    # even send it: the body is written by hand).
    body = b'{"prompt": "def \\ud800", "max_tokens": 2}'
    response = httpx.post(
        f"{server.base_url}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt" and "UTF-8" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "hi"}]}, "messages"),  # no role
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}, "max_completion_tokens"),
    ],
)
def test_bad_chat_requests(client: openai.OpenAI, request_body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/chat/completions", cast_to=object, body={"model": MODEL, **request_body})
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
    assert "tiny-pydoc" in info.value.body["message"]  # says what is served
    with pytest.raises(openai.NotFoundError):
        client.get("/no-such-path", cast_to=object)


def wait_idle(server: Server) -> None:
    """Until the server's engine runs and queues nothing and holds no KV cache block (or fail)."""
    for _ in range(100):
        if server.metric("num_requests_running") == server.metric("num_requests_waiting") == 0:
            break
        time.sleep(0.05)
    assert server.metric("num_requests_running") == server.metric("num_requests_waiting") == 0
    assert server.metric("kv_cache_usage_perc") == 0.0  # every block of the requests is free again


def test_client_that_goes_away_frees_its_request(server: Server) -> None:
    aborted = server.engine.stats.num_requests_aborted
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            lines = response.iter_lines()  # kept: a dropped iterator would close the response at once
            first = next(lines)
            assert json.loads(first.removeprefix("data: "))["choices"][0]["text"]
            assert server.metric("num_requests_running") == 1  # still generating when the client leaves
        wait_idle(server)
        # A non-streamed request whose client times out is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.5)
        wait_idle(server)
    # Aborted, not finished: the engine stopped both well before their 900 tokens.
    assert server.engine.stats.num_requests_aborted == aborted + 2


def test_load_of_concurrent_streams(server: Server, llm: LLM) -> None:
    """300 streams at once (the engine runs 64 at a time, the rest queue): every one complete and right."""
    prompts = [f"Item {i}: the" for i in range(300)]
    expected = [out.outputs[0].text for out in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        text, reason = "", None
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run())
    wrong = [i for i, ((text, reason), want) in enumerate(zip(results, expected)) if text != want or reason is None]
    assert wrong == []
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    wait_idle(server)


def test_echo_and_logit_bias(client: openai.OpenAI, llm: LLM) -> None:
    expected = offline(llm, PROMPT, max_tokens=5, temperature=0)[0].text
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert response.choices[0].text == PROMPT + expected
    # A bias of +100 on one token outweighs every logit of this model: worked out by hand, every
    # sampled token is that one (byte 65, "A").
    biased = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={"65": 100})
    if biased.choices[0].text == expected:
        pytest.skip("logit_bias: not implemented yet in the engine")
    assert biased.choices[0].text == "AAAAA"


def test_engine_that_stopped_is_a_500(llm: LLM) -> None:
    from fastapi.testclient import TestClient

    from pagedkv.engine.async_llm import AsyncLLM
    from pagedkv.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_llm(llm)  # the reference LLM, idle again after shutdown
    app = build_app(engine)
    engine.shutdown()
    with TestClient(app) as http:  # raises what reaches Starlette unhandled: nothing may
        assert http.get("/health").status_code == 503
        response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "internal_server_error" and "shut down" in error["message"]
        assert "Traceback" not in response.text


def test_penalties_reach_the_engine(client: openai.OpenAI, llm: LLM) -> None:
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    plain = offline(llm, "The list type", max_tokens=24, temperature=0)[0]
    expected = offline(llm, "The list type", max_tokens=24, temperature=0, **penalties)[0]
    if expected.token_ids == plain.token_ids:
        pytest.skip("presence/frequency/repetition penalties: not implemented yet in the engine")
    response = client.completions.create(
        model=MODEL,
        prompt="The list type",
        max_tokens=24,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.3, "return_token_ids": True},
    )
    assert response.choices[0].model_extra["token_ids"] == expected.token_ids
