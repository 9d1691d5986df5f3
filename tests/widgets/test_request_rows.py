"""RequestRowsView: on a tiny live engine, the rows handed out and given back as requests arrive and
finish, and what each step gathered from them (ids, positions, slots), against a run worked out by hand."""

from __future__ import annotations

import re

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.widgets import RequestRowsView
from pagedkv.widgets.request_rows import GatheredToken

Run = tuple[RequestRowsView, list[int], list[int], RequestRowsView]
"""The view, A's and C's sampled tokens, and a view of the same run drawing one row."""


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def run() -> Run:
    """Blocks of 4, 8 tokens a step, 2 rows. A (3 tokens, 2 new) and B (5 tokens, 1 new) arrive at once;
    C (2 tokens, 2 new) before step 2."""
    llm = LLM(
        "tiny",
        device="cpu",
        num_kv_blocks=16,
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        enable_prefix_caching=False,
    )
    view = RequestRowsView(llm, min_frame_s=0)
    narrow = RequestRowsView(llm, max_rows=1, min_frame_s=0)  # draws row 0 only
    llm.add_request({"prompt_token_ids": [11, 12, 13]}, greedy(2))
    llm.add_request({"prompt_token_ids": [21, 22, 23, 24, 25]}, greedy(1))
    outputs = llm.step()
    llm.add_request({"prompt_token_ids": [31, 32]}, greedy(2))
    outputs += llm.step() + llm.step()
    view.detach()
    narrow.detach()
    llm.generate([{"prompt_token_ids": [1, 2]}], greedy(1), use_tqdm=False)  # detached: not recorded
    last = {o.request_id: o.outputs[0].token_ids for o in outputs}
    return view, last["0"], last["2"], narrow


def tokens(req_id: str, row: int, positions: range, ids: list[int], slots: list[int]) -> list[GatheredToken]:
    return [GatheredToken(req_id, row, p, i, (s,)) for p, i, s in zip(positions, ids, slots, strict=True)]


def test_rows_follow_requests(run: Run) -> None:
    view, a_out, c_out, _ = run
    assert [s.step for s in view.steps] == [1, 2, 3]
    one, two, three = view.steps
    # Step 1: rows are handed out lowest first: A row 0, B row 1. B finishes (1 token).
    assert one.holders == {0: "0", 1: "1"} and one.handed_out == one.holders and one.given_back == {}
    assert one.finished == ["1"]
    # Step 2: B's row is given back before the step and C, arriving, gets it; A keeps row 0.
    assert two.given_back == {1: "1"} and two.handed_out == {1: "2"} and two.holders == {0: "0", 1: "2"}
    assert two.finished == ["0"]
    # Step 3: A finished in step 2, so its row is given back; C keeps row 1.
    assert three.given_back == {0: "0"} and three.handed_out == {} and three.holders == {1: "2"}
    # The rows' contents: prompt, then each token the host learned (C's row holds B's old tail past
    # position 1, which nothing reads: only C's own two tokens are shown).
    assert one.contents == {0: [11, 12, 13], 1: [21, 22, 23, 24, 25]}
    assert two.contents == {0: [11, 12, 13, a_out[0]], 1: [31, 32]}
    assert three.contents == {1: [31, 32, c_out[0]]}


def test_gathered_ids_positions_slots(run: Run) -> None:
    view, a_out, c_out, _ = run
    one, two, three = view.steps
    # The pool hands out blocks 1, 2, 3, ... in order; freed ones go to the back of the free queue.
    # A: block 1 (slots 4-7); B: blocks 2, 3 (slots 8-15); C, after B's blocks went to the back: block 4.
    assert one.schedule == [("0", 0, 0, 3), ("1", 1, 0, 5)] and one.rows_sent == [0, 1]
    assert one.gathered == tokens("0", 0, range(3), [11, 12, 13], [4, 5, 6]) + tokens(
        "1", 1, range(5), [21, 22, 23, 24, 25], [8, 9, 10, 11, 12]
    )
    # Step 2: A's decode first (position 3, its sampled token, slot 7), then C's prompt in row 1.
    assert two.schedule == [("0", 0, 3, 1), ("2", 1, 0, 2)]
    assert two.gathered == tokens("0", 0, range(3, 4), [a_out[0]], [7]) + tokens("2", 1, range(2), [31, 32], [16, 17])
    assert three.gathered == tokens("2", 1, range(2, 3), [c_out[0]], [18])


def test_drawing_and_text(run: Run) -> None:
    view, _, _, narrow = run
    view.index = 1
    assert repr(view) == "RequestRowsView(step 2, 3 recorded; row 0: req 0, row 1: req 2)"
    assert view.shown_rows(view.steps[1]) == [0, 1, 2]  # rows 0, 1 and the padding row (max_num_seqs = 2)
    table = view.table.value
    assert "given back before the step: row 1 (req 1)" in table
    assert "req 2 &rarr; row 1" in table
    assert "rows [0, 1], num_computed [3, 0], query_lens [1, 2]" in table
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", table)
    assert cells[-5:] == ["2", "1", "1", "32", "17"]  # token 2: row 1, position 1, id 32, slot 17
    assert view.figure.value.count("data:image/png;base64,") == 2  # a light and a dark rendering
    assert "step 2" in view.label.value
    with pytest.raises(IndexError, match="out of range"):
        view.index = 3
    assert narrow.shown_rows(narrow.steps[1]) == [0, 2]  # row 0 and the padding row
    assert "rows [1] are held but not drawn (max_rows=1)" in narrow.table_html(narrow.steps[1])
