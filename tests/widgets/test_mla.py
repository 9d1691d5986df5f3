"""Notebook 11's views on real tiny-mla runs: the MLA split a StepTrace records, MLASplitView's drawing
of it (live and replayed), and the cache sizes against the engine's own spec and hand-worked values."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.models.loader import PRESETS
from pagedkv.trace import StepTrace
from pagedkv.widgets import MLASplitView, cache_bytes, latent_cache_table
from pagedkv.widgets.common import PALETTE

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# Notebook 11's run: 3, 14, 46 and 4 tokens with BOS, 16 per step. Step 2 holds request 0's decode,
# request 1's last prompt token (a one-token chunk) and 14 tokens of request 2's prompt.
PROMPTS = ["Hi", "latent vector", "one latent row per token, shared by all heads", "MLA"]


def engine(model: str = "tiny-mla", **kwargs: int) -> LLM:
    return LLM(model, device="cpu", num_kv_blocks=32, block_size=16, max_num_batched_tokens=16, **kwargs)


@pytest.fixture(scope="module")
def run() -> tuple[StepTrace, list[tuple[int, int, int, int]]]:
    """The notebook's trace, and the split of every step read off the live metadata."""
    llm = engine()
    live: list[tuple[int, int, int, int]] = []

    def read_split(event) -> None:  # noqa: ANN001
        m = event.result.attn_metadata["model.layers.0.self_attn.attn"]
        live.append((m.num_decodes, m.num_decode_tokens, m.num_prefills, m.num_prefill_tokens))

    llm.add_step_listener(read_split)
    with StepTrace.attach(llm) as trace:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return trace, live


def test_trace_records_the_builders_split(run: tuple[StepTrace, list[tuple[int, int, int, int]]]) -> None:
    trace, live = run
    assert len(trace) == len(live) == 8
    for record, split in zip(trace, live):
        s = record.mla_split
        assert (s.num_decodes, s.num_decode_tokens, s.num_prefills, s.num_prefill_tokens) == split
        # By hand: the leading one-token requests are the decodes.
        lens = [r.num_new_tokens for r in record.scheduled]
        leading = next((i for i, n in enumerate(lens) if n > 1), len(lens))
        assert split == (leading, leading, len(lens) - leading, sum(lens[leading:]))
    step2 = trace[1]
    assert [(r.req_id, r.phase, r.num_new_tokens) for r in step2.scheduled] == [
        ("0", "decode", 1),
        ("1", "prefill", 1),
        ("2", "prefill", 14),
    ]
    assert step2.mla_split.num_decodes == 2  # request 1's one-token chunk counts as a decode


def test_split_survives_json_and_older_traces_load(run: tuple[StepTrace, list], tmp_path: Path) -> None:
    trace, _ = run
    loaded = StepTrace.load(trace.save(tmp_path / "mla.json"))
    assert loaded.steps == trace.steps
    old = trace.to_json().replace('"mla_split":', '"dropped":')  # a trace recorded before the field
    assert all(r.mla_split is None for r in StepTrace.from_json(old))
    html = MLASplitView(StepTrace.from_json(old), index=0).value  # an MLA model: not "has no MLA layers"
    assert "recorded before traces kept the split" in html and "no MLA layers" not in html


def test_tooltip_of_a_recomputed_request_counts_its_generated_tokens() -> None:
    """A preempted request recomputes its generated tokens too: they are not prompt positions."""
    llm = LLM("tiny-mla", device="cpu", num_kv_blocks=8, block_size=4, max_num_batched_tokens=32)
    with StepTrace.attach(llm) as trace:
        llm.generate(
            ["hello world!!", "abcdefghij", "a longer prompt"],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
    recomputes = 0
    for i, record in enumerate(trace):
        prompt_lens = {r.req_id: r.num_prompt_tokens for r in record.scheduled}
        computed = {r.req_id: (r.num_computed_tokens, r.num_new_tokens) for r in record.scheduled}
        for req_id, tip in re.findall(r"<title>request (\w+): ([^;]*);", MLASplitView(trace, index=i).value):
            span = re.fullmatch(r"(prefill of prompt|recompute of) positions (\d+)-(\d+)\b.*", tip)
            if span is None:
                continue
            first, count = computed[req_id]  # the scheduler's record, not the tooltip's own numbers
            assert (int(span[2]), int(span[3])) == (first, first + count - 1), tip
            beyond_prompt = int(span[3]) >= prompt_lens[req_id]
            assert (span[1] == "recompute of") == beyond_prompt, tip
            if beyond_prompt:
                generated = int(span[3]) + 1 - prompt_lens[req_id]
                assert f"({prompt_lens[req_id]} prompt + {generated} generated token" in tip, tip
                recomputes += 1
    assert sum(len(r.preempted_req_ids) for r in trace) and recomputes, "the run should preempt and recompute"


def test_models_without_mla_record_no_split() -> None:
    llm = engine("tiny")
    with StepTrace.attach(llm) as trace:
        llm.generate(["ab"], SamplingParams(temperature=0, max_tokens=2))
    assert [r.mla_split for r in trace] == [None, None]
    html = MLASplitView(trace).value
    assert "has no MLA layers" in html and "<svg" not in html


def _paths(html: str) -> list[tuple[str, str]]:
    return re.findall(r'class="pkv-mla-request" data-req-id="(\w+)" data-path="(\w+)"', html)


def test_view_draws_each_step(run: tuple[StepTrace, list]) -> None:
    trace, _ = run
    first, second, last = (MLASplitView(trace, index=i).value for i in (0, 1, -1))
    assert 'data-num-decode-tokens="0"' in first and "num_decode_tokens = 0" in first
    assert _paths(first) == [("0", "forward_mha"), ("1", "forward_mha")]
    assert "16 tokens: 0 decodes (0 tokens)" in first

    assert _paths(second) == [("0", "forward_mqa"), ("1", "forward_mqa"), ("2", "forward_mha")]
    assert "num_decode_tokens = 2" in second
    assert "2 decodes (2 tokens) &rarr; <b>forward_mqa</b>; 1 prefill (14 tokens) &rarr; <b>forward_mha</b>" in second
    assert "request 1 is still prefilling" in second and "TORCH_REF_MLA, latent rows of 40 values" in second
    # Request 2's 14 prompt positions: 0-5, then "+7" for 6-12, then 13.
    cells = re.findall(r'text-anchor="middle">([^<]+)</text>', second)
    assert cells == ["3", "13", "0", "1", "2", "3", "4", "5", "+7", "13"]

    assert _paths(last) == [("2", "forward_mqa"), ("3", "forward_mqa")]
    assert "still prefilling" not in last and "0 prefills (0 tokens)" in last


def test_boundary_sits_between_the_decodes_and_the_prefills(run: tuple[StepTrace, list]) -> None:
    trace, _ = run
    html = MLASplitView(trace, index=1).value
    boundary = float(re.search(r'<line x1="([\d.]+)"', html).group(1))
    xs = [float(x) for x in re.findall(r'<rect x="([\d.]+)"', html)]
    assert xs[1] < boundary < xs[2]  # after request 1's cell, before request 2's first


def test_live_view_matches_the_replay() -> None:
    llm = engine()
    view = MLASplitView.attach(llm)
    assert "waiting for the first step" in view.value
    drawn: list[str] = []
    view.trace.observe(lambda record: drawn.append(view.value))
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    replay = StepTrace.from_json(view.trace.to_json())
    assert drawn == [MLASplitView(replay, index=i).value for i in range(len(replay))]


def test_a_big_batch_narrows_its_cells() -> None:
    llm = LLM("tiny-mla", device="cpu", num_kv_blocks=64, block_size=16, max_num_batched_tokens=256, max_num_seqs=64)
    with StepTrace.attach(llm) as trace:
        llm.generate(
            [f"p{i}" for i in range(50)] + ["x" * 200],
            SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
            use_tqdm=False,
        )
    record = next(r for r in trace if r.mla_split.num_decodes == 50 and r.mla_split.num_prefills == 1)
    html = MLASplitView(trace, index=trace.steps.index(record)).value
    width = float(re.search(r'<svg class="pkv-mla-strip" width="(\d+)"', html).group(1))
    assert len(re.findall(r"<rect ", html)) == 50 + 8 and width <= 980
    assert 'text-anchor="middle"' not in html  # too narrow for position numbers: none drawn


HEX = re.compile(r"#[0-9a-fA-F]{6}\b|#[0-9a-fA-F]{3}\b")


def test_colours_follow_the_theme(run: tuple[StepTrace, list]) -> None:
    trace, _ = run
    for html in [MLASplitView(trace, index=i).value for i in range(len(trace))] + [latent_cache_table(PRESETS_MLA)]:
        assert set(HEX.findall(html)) <= set(PALETTE)
        assert "var(--jp-ui-font-color1" in html and not re.search(r"[:=]\s*\"?(white|black|gr[ae]y)\b", html)
        assert html.count("<svg") == html.count("fill: currentColor")


PRESETS_MLA = {"tiny-mla": PRESETS["tiny-mla"], "deepseek-v2-lite": PRESETS["deepseek-v2-lite"]}


def test_cache_bytes_by_hand() -> None:
    lite = cache_bytes(PRESETS["deepseek-v2-lite"])
    # bf16: 512 + 64 = 576 values = 1,152 B; MHA: 16 heads x (192 + 128) = 5,120 values = 10,240 B.
    assert (lite.mla_values, lite.mla_bytes, lite.mha_values, lite.mha_bytes) == (576, 1152, 5120, 10240)
    # 40 GB over 27 layers: 40e9 // (1,152 x 27) and 40e9 // (10,240 x 27).
    assert lite.tokens_in(40 * 10**9) == (1_286_008, 144_675)
    assert f"{lite.ratio:.2f}" == "8.89"
    tiny = cache_bytes(PRESETS["tiny-mla"], torch.float32)
    assert (tiny.mla_bytes, tiny.mha_bytes) == (40 * 4, 4 * (24 + 16) * 4)


def test_cache_bytes_agree_with_the_engine() -> None:
    llm = engine()
    spec = llm.runner.attn_layers["model.layers.0.self_attn.attn"].get_kv_cache_spec()
    sizes = cache_bytes(PRESETS["tiny-mla"], spec.dtype, spec.block_size)
    assert sizes.mla_bytes * spec.block_size * sizes.num_layers == llm.runner.kv_cache_config.bytes_per_block


def test_latent_cache_table() -> None:
    html = latent_cache_table(PRESETS_MLA, memory_bytes=40 * 10**9)
    row = re.search(r'<tr data-model="deepseek-v2-lite">(.*?)</tr>', html).group(1)
    text = re.sub(r"<[^>]+>", " ", row)
    for expected in (
        "27",
        "MLA 576 values = 1,152 B",
        "MHA 5,120 values = 10,240 B",
        "8.9x",
        "MLA 1,286,008",
        "MHA 144,675",
    ):
        assert expected in text, (expected, text)
    assert "tokens in 40 GB" in html and "(bfloat16)" in html
