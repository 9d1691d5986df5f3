"""`pagedkv lab`: every lab grades a right file ✓ (exit 0) and a wrong one ✗ (exit 1) with the notebook's own
checker; a file that cannot be graded, or an unknown lab, is one `pagedkv: error:` line (exit 2).

The right answers are worked out here by hand from each exercise's rules (the Triton puzzles: the notebooks'
worked kernels and answers), never by calling pagedkv's implementation; the wrong ones are the mistakes the
notebooks' first tries make, or a worked kernel with one rule broken.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedkv.__main__ import main as cli
from pagedkv.exercises import FAIL_MARK, PASS_MARK
from pagedkv.exercises.labs import LABS, defined_name, exercise_of
from tests.exercises.checks import NOTEBOOKS, notebook_cells, worked_solutions

RIGHT: dict[str, str] = {
    "choose-backend": """
        def choose_backend(priority, reasons):
            # The first listed backend that some registry knows and that gives no reason to refuse.
            for name in priority:
                if name in reasons and not reasons[name]:
                    return name
            return None
        """,
    "qkv-width": """
        def my_qkv_width(hidden_size, num_heads, num_kv_heads, head_dim, tp_size):
            # Query heads split; KV heads split, or one copy per rank when there are fewer than ranks.
            return (num_heads // tp_size + 2 * max(1, num_kv_heads // tp_size)) * head_dim
        """,
    "head-layout": """
        def my_head_layout(total_num_heads, total_num_kv_heads, tp_size):
            if total_num_heads % tp_size:
                return None
            if total_num_kv_heads >= tp_size:
                if total_num_kv_heads % tp_size:
                    return None
                return total_num_heads // tp_size, total_num_kv_heads // tp_size, 1
            if tp_size % total_num_kv_heads:
                return None
            return total_num_heads // tp_size, 1, tp_size // total_num_kv_heads
        """,
    "attention-context": """
        from pagedkv.forward_context import get_forward_context

        def my_attention_context(layer_name):
            ctx = get_forward_context()
            layer = ctx.no_compile_layers[layer_name]
            metadata = ctx.attn_metadata
            if isinstance(metadata, list):  # one dict per micro-batch: the first is the base model's
                metadata = metadata[0]
            return (
                None if metadata is None else metadata[layer_name],
                layer,
                layer.kv_cache,
                ctx.slot_mapping.get(layer_name),
            )
        """,
    "lengths": """
        def lengths(query_start_loc, seq_lens):
            query_lens = [int(b) - int(a) for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
            return query_lens, [int(s) - q for s, q in zip(seq_lens, query_lens)]
        """,
    "null-blocks": """
        def num_null_blocks(context_len, sliding_window, block_size):
            # The first query (position context_len) sees keys context_len - sliding_window + 1 on: the
            # whole blocks before that key are out of every query's window.
            return max(0, context_len - sliding_window + 1) // block_size
        """,
    "kernel-row": """
        def kernel_row(row, block_size, kernel_block_size):
            k = block_size // kernel_block_size
            return [block * k + i for block in row for i in range(k)]
        """,
    "rank-heads": """
        def my_rank_heads(num_heads, num_kv_heads, tp_size, rank):
            q = num_heads // tp_size
            queries = list(range(rank * q, rank * q + q))
            if num_kv_heads >= tp_size:
                kv = num_kv_heads // tp_size
                return queries, list(range(rank * kv, rank * kv + kv))
            return queries, [rank * num_kv_heads // tp_size]  # tp_size / num_kv_heads ranks share a KV head
        """,
    "kv-cache-bytes": """
        def my_kv_cache_bytes(num_layers, num_heads, num_kv_heads, head_dim, tp_size, num_blocks):
            kv_heads = max(1, num_kv_heads // tp_size)
            return num_blocks * 16 * num_layers * 2 * kv_heads * head_dim * 2  # K and V, bf16
        """,
    "mqa-query": """
        import torch

        def my_mqa_query(q, kv_b_weight, qk_nope_head_dim):
            tokens, heads, _ = q.shape
            w = kv_b_weight.view(heads, -1, kv_b_weight.shape[1])  # [heads, nope + v, kv_lora_rank]
            w_uk = w[:, :qk_nope_head_dim, :]
            # score = q_nope . (W_UK c) = (W_UK^T q_nope) . c
            absorbed = torch.einsum("thn,hnr->thr", q[..., :qk_nope_head_dim], w_uk)
            return torch.cat([absorbed, q[..., qk_nope_head_dim:]], dim=-1)
        """,
    "mla-cache-bytes": """
        def my_mla_cache_bytes(num_layers, kv_lora_rank, qk_rope_head_dim, num_tokens):
            return num_layers * num_tokens * (kv_lora_rank + qk_rope_head_dim) * 2
        """,
    "decode-split": """
        def my_split(query_lens):
            n = 0  # the batch is reordered decodes first: the leading one-token requests are the decodes
            while n < len(query_lens) and query_lens[n] == 1:
                n += 1
            return n, len(query_lens) - n, sum(query_lens[:n]), sum(query_lens[n:])
        """,
    "hit-length": """
        def my_hit_length(cached_prompts, prompt, block_size):
            full = {tuple(p[:end]) for p in cached_prompts for end in range(block_size, len(p) + 1, block_size)}
            hit = 0
            while hit + block_size <= len(prompt) - 1 and tuple(prompt[: hit + block_size]) in full:
                hit += block_size
            return hit
        """,
    "next-block": """
        def my_next_block(events, num_blocks, block_size):
            free, refs, by_prefix, prefix_of, held = list(range(1, num_blocks)), {}, {}, {}, {}
            for event in events:
                if event[0] == "free":
                    for block in reversed(held.pop(event[1])):
                        refs[block] -= 1
                        if refs[block] == 0:
                            free.append(block)
                    continue
                _, request, tokens = event
                blocks = []
                for end in range(block_size, len(tokens), block_size):  # full blocks, not the last token's
                    block = by_prefix.get(tuple(tokens[:end]))
                    if block is None:
                        break
                    if refs.get(block, 0) == 0:
                        free.remove(block)
                    refs[block] = refs.get(block, 0) + 1
                    blocks.append(block)
                while len(blocks) * block_size < len(tokens):
                    block = free.pop(0)
                    if block in prefix_of:
                        del by_prefix[prefix_of.pop(block)]
                    refs[block] = 1
                    blocks.append(block)
                for j in range(len(tokens) // block_size):
                    prefix = tuple(tokens[: (j + 1) * block_size])
                    if prefix not in by_prefix:
                        by_prefix[prefix], prefix_of[blocks[j]] = blocks[j], prefix
                held[request] = blocks
            return free[0]
        """,
    "emitted": """
        def my_emitted(draft_token_ids, target_token_ids):
            out = []
            for draft, target in zip(draft_token_ids, target_token_ids):
                if draft != target:
                    return out + [target]  # the correction
                out.append(draft)
            return out + [target_token_ids[len(draft_token_ids)]]  # every draft accepted: the bonus token
        """,
    "rollback-slots": """
        def my_rollback_slots(block_ids, block_size, num_computed_tokens, draft_token_ids, num_accepted_tokens):
            # Draft j sits at position num_computed_tokens + 1 + j; the rejected ones are j >= num_accepted_tokens.
            positions = range(num_computed_tokens + 1 + num_accepted_tokens, num_computed_tokens + 1 + len(draft_token_ids))
            return [block_ids[p // block_size] * block_size + p % block_size for p in positions]
        """,
    "num-splits": """
        def my_num_splits(seq_len, batch_size, num_sms):
            return min(64, (seq_len + 255) // 256)  # a fixed split size: the count follows the request alone
        """,
    "num-blocks": """
        def my_num_blocks(memory_bytes, config, block_size, kv_cache_dtype):
            value = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1}[kv_cache_dtype]
            per_block = config.num_hidden_layers * 2 * block_size * config.num_key_value_heads * config.head_dim * value
            return memory_bytes // per_block
        """,
    "idle-gap": """
        def my_idle_gap(profile, step):
            # Listed by start, so the previous step's work ends at its LATEST end, not at its last range's end.
            ends = [d.end for d in profile.device if d.step == step - 1]
            starts = [d.start for d in profile.device if d.step == step]
            return max(0.0, min(starts) - max(ends))
        """,
}

WRONG: dict[str, str] = {
    "choose-backend": """
        def choose_backend(priority, reasons):
            return priority[0]
        """,
    "qkv-width": """
        def my_qkv_width(hidden_size, num_heads, num_kv_heads, head_dim, tp_size):
            return (num_heads + 2 * num_kv_heads) * head_dim // tp_size  # KV heads never replicated
        """,
    "head-layout": """
        def my_head_layout(total_num_heads, total_num_kv_heads, tp_size):
            return total_num_heads // tp_size, total_num_kv_heads // tp_size, 1
        """,
    "attention-context": """
        from pagedkv.forward_context import get_forward_context

        def my_attention_context(layer_name):
            ctx = get_forward_context()
            layer = ctx.no_compile_layers[layer_name]
            return ctx.attn_metadata, layer, layer.kv_cache, ctx.slot_mapping.get(layer_name)  # the whole dict
        """,
    "lengths": """
        def lengths(query_start_loc, seq_lens):
            query_lens = [int(b) - int(a) for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
            return query_lens, [int(s) for s in seq_lens]
        """,
    "null-blocks": """
        def num_null_blocks(context_len, sliding_window, block_size):
            return max(0, context_len - sliding_window) // block_size  # off by one key
        """,
    "kernel-row": """
        def kernel_row(row, block_size, kernel_block_size):
            k = block_size // kernel_block_size
            return [b + i for b in row for i in range(k)]
        """,
    "rank-heads": """
        def my_rank_heads(num_heads, num_kv_heads, tp_size, rank):
            q, kv = num_heads // tp_size, max(num_kv_heads // tp_size, 1)
            return list(range(rank * q, (rank + 1) * q)), list(range(rank * kv, (rank + 1) * kv))
        """,
    "kv-cache-bytes": """
        def my_kv_cache_bytes(num_layers, num_heads, num_kv_heads, head_dim, tp_size, num_blocks):
            return num_blocks * 16 * num_layers * 2 * num_kv_heads * head_dim * 2 // tp_size
        """,
    "mqa-query": """
        def my_mqa_query(q, kv_b_weight, qk_nope_head_dim):
            return q  # not absorbed
        """,
    "mla-cache-bytes": """
        def my_mla_cache_bytes(num_layers, kv_lora_rank, qk_rope_head_dim, num_tokens):
            return num_layers * num_tokens * 2 * (kv_lora_rank + qk_rope_head_dim) * 2  # a K and a V row
        """,
    "decode-split": """
        def my_split(query_lens):
            ones = [n for n in query_lens if n == 1]
            longer = [n for n in query_lens if n != 1]
            return len(ones), len(longer), len(ones), sum(longer)
        """,
    "hit-length": """
        def my_hit_length(cached_prompts, prompt, block_size):
            hit = 0
            for p in cached_prompts:
                n = 0
                while n < min(len(p), len(prompt)) and p[n] == prompt[n]:
                    n += 1
                hit = max(hit, n // block_size * block_size)
            return hit
        """,
    "next-block": """
        def my_next_block(events, num_blocks, block_size):
            return 1
        """,
    "emitted": """
        def my_emitted(draft_token_ids, target_token_ids):
            return [d for d, t in zip(draft_token_ids, target_token_ids) if d == t] + [target_token_ids[-1]]
        """,
    "rollback-slots": """
        def my_rollback_slots(block_ids, block_size, num_computed_tokens, draft_token_ids, num_accepted_tokens):
            first = num_computed_tokens + 1 + num_accepted_tokens
            return list(range(first, num_computed_tokens + 1 + len(draft_token_ids)))
        """,
    "num-splits": """
        def my_num_splits(seq_len, batch_size, num_sms):
            return max(1, min(64, (seq_len + 15) // 16, 4 * num_sms // batch_size))  # fills the GPU: batch-dependent
        """,
    "num-blocks": """
        def my_num_blocks(memory_bytes, config, block_size, kv_cache_dtype):
            value = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1}[kv_cache_dtype]
            return memory_bytes // (config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * value)
        """,
    "idle-gap": """
        def my_idle_gap(profile, step):
            last = [d for d in profile.device if d.step == step - 1][-1]  # the last listed: not the last to end
            first = [d for d in profile.device if d.step == step][0]
            return max(0.0, first.start - last.end)
        """,
}

# The value labs (08's lowering questions, 13's modes): right, the notebooks' worked answers; wrong, a mode that
# none of them is, or a rule left out.
WRONG_VALUES = {
    **{f"lowering-{n}": f'answer_{n} = "FULL"' for n in range(1, 6)},
    "raising": 'answer_6 = {("FULL", "NEVER"), ("FULL_DECODE_ONLY", "NEVER")}',
    "spec-modes": 'my_modes = {"a": "NONE", "b": "NONE", "c": "NONE", "d": "NONE"}',
}
TRITON = [name for name, lab in LABS.items() if "triton" in lab.checker or "prefill_ladder" in lab.checker]
# The Triton labs: right, the notebooks' worked kernels; wrong, the same with one rule broken (old -> new).
TRITON_SLIPS = {
    "block-table-row": ("pos % PAGE_SIZE, -1)", "pos % PAGE_SIZE, 0)"),  # padding slots not -1
    "scatter": (
        "tl.store(v_cache_ptr + dst, tl.load(value_ptr + src))",
        "tl.store(v_cache_ptr + dst, tl.load(key_ptr + src))",
    ),
    "page-scores": ("s = tl.sum(q[None, :] * k, 1) * scale", "s = tl.sum(q[None, :] * k, 1)"),  # no scale
    "masked-scores": ('* scale, float("-inf"))', "* scale, 0.0)"),  # keys past seq_len score 0, not -inf
    "online-softmax": ("dims, acc / l_i)", "dims, acc)"),  # never normalised
    "gqa": ("s = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale", "s = tl.sum(q[:, None, :] * k[None, :, :], 2)"),
    "split-kv": ("m_i + tl.log(l_safe)", "m_i"),  # a split's lse without its denominator
    "flash-prefill": ("acc / l_i[:, None], mask=", "acc, mask="),
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `pagedkv ARGV`, called in this process."""
    try:
        cli(list(argv))
        code = 0
    except SystemExit as exited:
        code = int(exited.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def start(capsys: pytest.CaptureFixture[str], name: str, path: Path) -> str:
    """The starter of lab `name`, written to `path` by `pagedkv lab start`."""
    assert run(capsys, "lab", "start", name, str(path))[0] == 0
    return path.read_text()


def triton_solution(capsys: pytest.CaptureFixture[str], name: str, path: Path, slip: bool = False) -> str:
    """Lab `name`'s starter with its kernels replaced by the notebook's worked ones (its launcher is the
    skeleton's), with its slip (TRITON_SLIPS) if `slip`: the worked solutions are in the notebook's order,
    one per lab of that notebook."""
    lab = LABS[name]
    of_notebook = [n for n in TRITON if LABS[n].notebook == lab.notebook]
    code = worked_solutions(f"{lab.notebook}.ipynb")[of_notebook.index(name)]
    kernels = "\n".join(line for line in code.splitlines() if not line.startswith("print("))
    if slip:
        old, new = TRITON_SLIPS[name]
        assert kernels.count(old) == 1, (name, old)
        kernels = kernels.replace(old, new)
    return start(capsys, name, path) + "\n\n" + kernels  # later definitions win


def worked_value(name: str) -> str:
    """The notebook's worked answer of value lab `name` (`answer_2 = "..."`), without its check."""
    lab = LABS[name]
    code = next(c for c in worked_solutions(f"{lab.notebook}.ipynb") if f"\n{lab.defines[0]} = " in f"\n{c}")
    return "\n".join(line for line in code.splitlines() if not line.startswith("print("))


def test_every_function_writing_lab_has_a_right_and_a_wrong_answer_here() -> None:
    assert sorted(RIGHT) == sorted(WRONG) == sorted(set(LABS) - set(TRITON) - set(WRONG_VALUES))
    assert sorted(TRITON) == sorted(TRITON_SLIPS) and len(TRITON) == 8  # 06's seven puzzles, 15's rung 1
    assert sorted(WRONG_VALUES) == sorted(name for name, lab in LABS.items() if lab.value is not None)


@pytest.mark.parametrize("name", list(LABS))
def test_a_right_file_passes_and_a_wrong_one_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    right, wrong = tmp_path / "right.py", tmp_path / "wrong.py"
    if name in TRITON:
        right.write_text(triton_solution(capsys, name, right))
        wrong.write_text(triton_solution(capsys, name, wrong, slip=True))
    elif name in WRONG_VALUES:
        right.write_text(worked_value(name))
        wrong.write_text(WRONG_VALUES[name])
    else:
        right.write_text(textwrap.dedent(RIGHT[name]))
        wrong.write_text(textwrap.dedent(WRONG[name]))
    code, out, err = run(capsys, "lab", "check", name, str(right))
    assert (code, out.startswith(PASS_MARK)) == (0, True), out + err
    code, out, err = run(capsys, "lab", "check", name, str(wrong))
    assert (code, out.startswith(FAIL_MARK)) == (1, True), out + err


@pytest.mark.parametrize("name", list(LABS))
def test_a_starter_checked_as_it_is_fails_and_names_the_lab_and_its_notebook(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    """A starter that still holds the notebook's `...` (a value lab's) or kernels that store nothing is not
    counted as a try by its checker (○), but it does not pass either."""
    path = tmp_path / "mine.py"
    text = start(capsys, name, path)
    lab = LABS[name]
    assert f"pagedkv lab check {name} {path}" in text and lab.notebook in text
    code, out, err = run(capsys, "lab", "check", name, str(path))
    assert (code, out[:1] in (FAIL_MARK, "○"), err) == (1, True, ""), out
    assert lab.value is not None or name in TRITON or out.startswith(FAIL_MARK)


def test_starters_carry_the_notebooks_skeleton_and_exercise_text(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    block_table_row = start(capsys, "block-table-row", tmp_path / "a.py")
    assert "### Puzzle 1 · load one block-table row" in block_table_row
    assert "    # TODO: in_seq = pos < seq_len of this request" in block_table_row  # the skeleton's hints
    assert "print(check_" not in block_table_row and "from pagedkv.exercises" not in block_table_row
    qkv = start(capsys, "qkv-width", tmp_path / "b.py")
    assert "## Exercise 1: one rank's `qkv_proj`" in qkv
    assert "A first try that forgets about the GPUs:" not in qkv  # it introduced a notebook cell a lab lacks
    lowering = start(capsys, "lowering-2", tmp_path / "c.py")  # a value lab: the configuration the notebook prints
    assert "### Exercise 2 (rule 2)" in lowering and re.search(r"^    cudagraph_mode +FULL$", lowering, re.M)
    assert lowering.endswith("\nanswer_2 = ...\n") and "Set answer_2 to a CUDAGraphMode or its name" in lowering
    assert qkv.endswith("    ...  # your code here\n") and "def my_qkv_width(hidden_size: int, num_heads: int," in qkv


def test_start_does_not_overwrite_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "mine.py"
    path.write_text("my work\n")
    code, out, err = run(capsys, "lab", "start", "qkv-width", str(path))
    assert (code, err) == (
        2,
        f"pagedkv: error: {path} exists (your work?); name another file, or --force replaces it\n",
    )
    assert path.read_text() == "my work\n"
    assert run(capsys, "lab", "start", "qkv-width", str(path), "--force")[0] == 0
    assert "def my_qkv_width" in path.read_text()


def test_list_names_every_lab_its_notebook_and_what_to_write(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "lab", "list")
    lines = out.splitlines()
    assert code == 0 and [line.split()[0] for line in lines] == list(LABS)
    assert lines[1].split(None, 2) == [
        "qkv-width",
        "01_the_model_file",
        "my_qkv_width(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int) -> int",
    ]
    assert (
        "split_partial_kernel (a @triton.jit kernel); split_merge_kernel (a @triton.jit kernel); split_kv_launch("
        in out
    )


NOT_LABS = {
    "check_blocks_held": "02: about the engine state the notebook built and shows",
    "check_next_slot_mapping": "02: the same",
    "check_next_schedule": "09: about the scheduler's state the notebook built and shows",
    "check_backend": "04: the backend subclasses NAIVE classes defined in the notebook",
}


def test_every_checker_a_notebook_calls_is_a_lab_or_said_not_to_be() -> None:
    """A new exercise gets a lab, or a line in NOT_LABS saying why not."""
    called = {
        checker
        for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
        for cell in notebook_cells(path.name)
        if cell["cell_type"] == "code"
        for checker in re.findall(r"\b(check_\w+)\(", "".join(cell["source"]))
    }
    graded = {lab.checker.partition(":")[2] for lab in LABS.values()}
    assert (sorted(called - graded), sorted(graded - called)) == (sorted(NOT_LABS), [])


@pytest.mark.parametrize("name", list(LABS))
def test_each_lab_names_what_its_notebook_defines(name: str) -> None:
    """The lab's names are the skeleton's, in its order (a notebook edit that renames one fails here)."""
    assert [defined_name(node) for node in exercise_of(LABS[name]).definitions] == list(LABS[name].defines)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x = 1\ndef f(:\n    pass\n", "{path}, line 2: SyntaxError: invalid syntax"),
        ("def f():\n  return 1\n   return 2\n", "{path}, line 3: IndentationError: unexpected indent"),
        (
            "import math\n\nx = 1 / 0\n",
            "{path}, line 3: ZeroDivisionError: division by zero (raised while importing the file)",
        ),
        ("import sys\nsys.exit(3)\n", "{path}, line 2: SystemExit: 3 (raised while importing the file)"),
        (
            "def my_qkv_widht(*args):\n    return 0\n",
            "{path} defines no my_qkv_width: the lab qkv-width grades my_qkv_width(",
        ),
    ],
    ids=["syntax", "indentation", "raises", "exits", "misspelt"],
)
def test_a_file_that_cannot_be_graded_is_one_error_line_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "mine.py"
    path.write_text(text)
    code, out, err = run(capsys, "lab", "check", "qkv-width", str(path))
    assert (code, out) == (2, "")
    assert err.startswith("pagedkv: error: " + message.format(path=path)) and err.count("\n") == 1, err


def test_a_missing_file_and_an_unknown_lab_are_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "nowhere.py"
    assert run(capsys, "lab", "check", "qkv-width", str(path)) == (
        2,
        "",
        f"pagedkv: error: {path}: no such file (pagedkv lab start qkv-width {path} writes a starter)\n",
    )
    assert run(capsys, "lab", "check", "qkv-width", str(tmp_path)) == (
        2,
        "",
        f"pagedkv: error: {tmp_path} is not a file: give the Python file that defines my_qkv_width\n",
    )
    code, out, err = run(capsys, "lab", "check", "qkv_width", str(path))
    assert (code, out) == (2, "")
    assert (
        err
        == f"pagedkv: error: no lab 'qkv_width'; the labs are: {', '.join(LABS)} (pagedkv lab list shows what each needs)\n"
    )


def test_python_m_pagedkv_lab_check_exits_0_then_1(tmp_path: Path) -> None:
    """The real entry point, in a process of its own (the other tests call main() in this one)."""
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_DEBUG"}
    right, wrong = tmp_path / "right.py", tmp_path / "wrong.py"
    right.write_text(textwrap.dedent(RIGHT["kernel-row"]))
    wrong.write_text(textwrap.dedent(WRONG["kernel-row"]))
    done = [
        subprocess.run(
            [sys.executable, "-m", "pagedkv", "lab", "check", "kernel-row", str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        for path in (right, wrong)
    ]
    assert [d.returncode for d in done] == [0, 1], [d.stderr for d in done]
    assert re.match(f"{PASS_MARK} .*correct|{PASS_MARK} ", done[0].stdout) and done[1].stdout.startswith(FAIL_MARK)
    assert "reveal()" not in done[1].stdout  # one try: the notebook's offer of a worked answer never shows
