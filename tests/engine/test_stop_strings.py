"""`stop` strings, `stop_token_ids` and `min_tokens` on the trained tiny-pydoc, hand-worked from its greedy
output: its tokenizer is byte-level, so every ASCII character is one token and the cut text and the
tokens kept can be read off the greedy text by position."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine.detokenizer import find_stop_string
from pagedkv.engine.request import RequestOutput

PROMPT = "The for statement"
GREEDY_START = '\n*******************\n\nThe "with" statem'
"""The first 37 characters of tiny-pydoc's greedy continuation of PROMPT (a heading's underline, then text)."""


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-pydoc", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def greedy(llm: LLM) -> RequestOutput:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.outputs[0].text.startswith(GREEDY_START)
    assert out.outputs[0].token_ids[: len(GREEDY_START)] == list(GREEDY_START.encode())
    return out


def run(llm: LLM, **params: object) -> tuple[str, list[int], str | None, int | str | None]:
    params = {"temperature": 0, "max_tokens": 40, **params}
    out = llm.generate(PROMPT, SamplingParams(**params))[0].outputs[0]  # type: ignore[arg-type]
    return out.text, out.token_ids, out.finish_reason, out.stop_reason


def test_find_stop_string_searches_only_the_new_text_and_the_characters_before_it() -> None:
    # "hello world", the last 3 characters new: "wor" begins 2 = len - 1 characters before them.
    assert find_stop_string("hello world", 3, ["wor"], include=False) == ("wor", 6)
    assert find_stop_string("hello world", 3, ["wor"], include=True) == ("wor", 9)
    assert find_stop_string("hello world", 3, ["hello"], include=False) is None  # searched before
    assert find_stop_string("hello world", 3, ["lo w"], include=False) is None  # ends before the new text
    assert find_stop_string("hello world", 0, ["d"], include=False) is None
    # Of two found in the new text, the earlier one in the text.
    assert find_stop_string("hello world", 5, ["ld", "wo"], include=False) == ("wo", 6)


@pytest.mark.parametrize(
    ("stop", "include"),
    [('"w', False), ('"w', True), ("with", False), ("with", True), ("\n\n", False), ("*", False)],
)
def test_a_stop_string_cuts_the_text_and_keeps_the_tokens(
    llm: LLM, greedy: RequestOutput, stop: str, include: bool
) -> None:
    # One token per character: the string ends with the token at index end - 1, the last one generated.
    start = GREEDY_START.index(stop)
    end = start + len(stop)
    text, tokens, reason, stop_reason = run(llm, stop=["never there", stop], include_stop_str_in_output=include)
    assert text == GREEDY_START[: end if include else start]
    assert tokens == greedy.outputs[0].token_ids[:end]
    assert (reason, stop_reason) == ("stop", stop)


def test_min_tokens_delays_the_search(llm: LLM) -> None:
    # "*" first ends the 2nd token; with min_tokens=5 the text of the first 5 tokens is never searched,
    # and the 6th token ("*") ends it: the text is cut before it.
    assert run(llm, stop=["*"])[:2] == ("\n", list(b"\n*"))
    text, tokens, reason, stop_reason = run(llm, stop=["*"], min_tokens=5)
    assert (text, tokens, reason, stop_reason) == ("\n****", list(b"\n*****"), "stop", "*")
    # A string may begin in the unsearched text as long as it ends after it: "**" at characters 4-5 (the
    # first found in the 6th token's new text, searched with the one character before it).
    assert run(llm, stop=["**"], min_tokens=5)[:2] == ("\n***", list(b"\n*****"))


def test_stop_token_ids_and_eos_give_their_stop_reason(llm: LLM, greedy: RequestOutput) -> None:
    star = ord("*")
    text, tokens, reason, stop_reason = run(llm, stop_token_ids=[star])
    assert (tokens, reason, stop_reason) == ([10, star], "stop", star)
    # min_tokens holds it off: the request gets 3 tokens at least (the stop check passes over a "*" before
    # them, and the sampler does not draw one), and a stop on it is its last token.
    _, tokens, reason, stop_reason = run(llm, stop_token_ids=[star], min_tokens=3)
    assert len(tokens) >= 3 and (reason, stop_reason) in {("stop", star), ("length", None)}
    assert reason == "length" or tokens[-1] == star
    assert run(llm, max_tokens=3)[2:] == ("length", None)


def test_streamed_text_only_grows_and_ends_as_generate(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, stop=["with"])
    request_id = llm.add_request(PROMPT, params)
    texts = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id == request_id
            texts.append(out.outputs[0].text)
    final = GREEDY_START[: GREEDY_START.index("with")]
    assert texts[-1] == final
    # The last 3 characters (len("with") - 1) are held back until they cannot begin "with".
    assert all(final.startswith(t) for t in texts), texts
    assert len(texts) == len(final) + len("with") and texts[:3] == ["", "", ""]


def test_a_request_that_reaches_max_tokens_in_its_stop_string_stops_on_it(llm: LLM) -> None:
    end = GREEDY_START.index("with") + len("with")
    assert run(llm, stop=["with"], max_tokens=end)[2:] == ("stop", "with")
    assert run(llm, stop=["with"], max_tokens=end - 1)[2:] == ("length", None)
