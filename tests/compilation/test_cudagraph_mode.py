"""CUDA graph modes and their lowering (`pagedkv.compilation`, issue 9 point 1).

The expected modes are a table written out by hand from the rules in the issue, not
computed by any helper: 5 modes x 4 support levels, each line giving the 8 combinations of
(attention compiled piecewise, decode query length, enforce_eager).
"""

from __future__ import annotations

import ast
import inspect
import itertools
import logging
import re
from pathlib import Path

import pytest

from pagedkv.attention.backend import AttentionCGSupport
from pagedkv.compilation import resolve_cudagraph_mode, resolve_explained
from pagedkv.config import CUDAGraphMode

M = CUDAGraphMode
S = AttentionCGSupport
BACKEND = "MY_TEST_BACKEND"

# Columns, in this order (pw: attention compiled piecewise; q: decode query length):
#   pw q=1 | pw q=1 eager | pw q=2 | pw q=2 eager | no-pw q=1 | no-pw q=1 eager | no-pw q=2 | no-pw q=2 eager
# FDO = FULL_DECODE_ONLY, FAP = FULL_AND_PIECEWISE, PW = PIECEWISE, ERR = ValueError.
TABLE = """
NONE               NEVER                        NONE NONE NONE NONE NONE NONE NONE NONE
NONE               UNIFORM_SINGLE_TOKEN_DECODE  NONE NONE NONE NONE NONE NONE NONE NONE
NONE               UNIFORM_BATCH                NONE NONE NONE NONE NONE NONE NONE NONE
NONE               ALWAYS                       NONE NONE NONE NONE NONE NONE NONE NONE
PIECEWISE          NEVER                        PW   NONE PW   NONE NONE NONE NONE NONE
PIECEWISE          UNIFORM_SINGLE_TOKEN_DECODE  PW   NONE PW   NONE NONE NONE NONE NONE
PIECEWISE          UNIFORM_BATCH                PW   NONE PW   NONE NONE NONE NONE NONE
PIECEWISE          ALWAYS                       PW   NONE PW   NONE NONE NONE NONE NONE
FULL               NEVER                        ERR  NONE ERR  NONE ERR  NONE ERR  NONE
FULL               UNIFORM_SINGLE_TOKEN_DECODE  FAP  NONE PW   NONE FDO  NONE NONE NONE
FULL               UNIFORM_BATCH                FAP  NONE FAP  NONE FDO  NONE FDO  NONE
FULL               ALWAYS                       FULL NONE FULL NONE FULL NONE FULL NONE
FULL_DECODE_ONLY   NEVER                        PW   NONE PW   NONE NONE NONE NONE NONE
FULL_DECODE_ONLY   UNIFORM_SINGLE_TOKEN_DECODE  FDO  NONE PW   NONE FDO  NONE NONE NONE
FULL_DECODE_ONLY   UNIFORM_BATCH                FDO  NONE FDO  NONE FDO  NONE FDO  NONE
FULL_DECODE_ONLY   ALWAYS                       FDO  NONE FDO  NONE FDO  NONE FDO  NONE
FULL_AND_PIECEWISE NEVER                        PW   NONE PW   NONE NONE NONE NONE NONE
FULL_AND_PIECEWISE UNIFORM_SINGLE_TOKEN_DECODE  FAP  NONE PW   NONE FDO  NONE NONE NONE
FULL_AND_PIECEWISE UNIFORM_BATCH                FAP  NONE FAP  NONE FDO  NONE FDO  NONE
FULL_AND_PIECEWISE ALWAYS                       FAP  NONE FAP  NONE FDO  NONE FDO  NONE
"""
ABBREVIATIONS = {"PW": "PIECEWISE", "FDO": "FULL_DECODE_ONLY", "FAP": "FULL_AND_PIECEWISE"}
COLUMNS = list(itertools.product([True, False], [1, 2], [False, True]))  # (pw, q, eager)


def _cases() -> list[tuple[CUDAGraphMode, AttentionCGSupport, bool, int, bool, str]]:
    cases = []
    for line in TABLE.strip().splitlines():
        mode, support, *results = line.split()
        assert len(results) == len(COLUMNS), line
        for (pw, q, eager), result in zip(COLUMNS, results):
            cases.append((M[mode], S[support], pw, q, eager, ABBREVIATIONS.get(result, result)))
    return cases


CASES = _cases()


def test_the_table_covers_every_combination() -> None:
    combos = {(mode, support, pw, q, eager) for mode, support, pw, q, eager, _ in CASES}
    assert len(CASES) == len(combos) == 5 * 4 * 2 * 2 * 2 == 160


@pytest.mark.parametrize(
    ("mode", "support", "piecewise", "qlen", "eager", "expected"),
    CASES,
    ids=[f"{c[0].name}-{c[1].name}-{'pw' if c[2] else 'nopw'}-q{c[3]}{'-eager' if c[4] else ''}" for c in CASES],
)
def test_resolution_table(
    caplog: pytest.LogCaptureFixture,
    mode: CUDAGraphMode,
    support: AttentionCGSupport,
    piecewise: bool,
    qlen: int,
    eager: bool,
    expected: str,
) -> None:
    kwargs = dict(
        backend_name=BACKEND, attention_compiled_piecewise=piecewise, uniform_decode_query_len=qlen, enforce_eager=eager
    )
    caplog.set_level(logging.WARNING, logger="pagedkv")
    if expected == "ERR":
        with pytest.raises(ValueError, match=f"not supported with {BACKEND} backend"):
            resolve_cudagraph_mode(mode, support, **kwargs)
        return
    resolved = resolve_cudagraph_mode(mode, support, **kwargs)
    assert resolved is M[expected]
    warnings = [r for r in caplog.records if r.name == "pagedkv" and r.levelno == logging.WARNING]
    # A change is always announced, in the words vLLM's warnings use; no change, no warning.
    assert bool(warnings) == (resolved is not mode)
    for record in warnings:
        assert re.fullmatch(
            r"CUDAGraphMode\.\w+ is not supported with .+; setting cudagraph_mode=\w+ \(.+\)", record.getMessage()
        )
    if warnings:
        assert f"CUDAGraphMode.{mode.name} is not supported with " in warnings[0].getMessage()
        assert f"; setting cudagraph_mode={resolved.name} (" in warnings[-1].getMessage()


def test_full_with_a_backend_that_never_captures_raises_the_documented_message() -> None:
    message = (
        "CUDAGraphMode.FULL is not supported with TORCH_REF backend (support: NEVER); "
        "please try cudagraph_mode=PIECEWISE"
    )
    for piecewise in (True, False):
        with pytest.raises(ValueError) as info:
            resolve_cudagraph_mode(M.FULL, S.NEVER, backend_name="TORCH_REF", attention_compiled_piecewise=piecewise)
        assert str(info.value) == message


def test_each_lowering_step_logs_its_own_warning(caplog: pytest.LogCaptureFixture) -> None:
    """FULL with single-token support and 2-token decodes is lowered twice (rules 2 and 4)."""
    caplog.set_level(logging.WARNING, logger="pagedkv")
    resolved = resolve_cudagraph_mode(
        "full",
        S.UNIFORM_SINGLE_TOKEN_DECODE,
        backend_name="FLASH_ATTN",
        attention_compiled_piecewise=True,
        uniform_decode_query_len=2,
    )
    assert resolved is M.PIECEWISE
    messages = [r.getMessage() for r in caplog.records if r.name == "pagedkv"]
    assert len(messages) == 2
    assert messages[0].startswith(
        "CUDAGraphMode.FULL is not supported with FLASH_ATTN backend (support: UNIFORM_SINGLE_TOKEN_DECODE); "
        "setting cudagraph_mode=FULL_AND_PIECEWISE ("
    )
    assert "support ALWAYS" in messages[0]
    assert messages[1].startswith(
        "CUDAGraphMode.FULL_AND_PIECEWISE is not supported with FLASH_ATTN backend "
        "(support: UNIFORM_SINGLE_TOKEN_DECODE); setting cudagraph_mode=PIECEWISE ("
    )
    assert "2 query tokens" in messages[1]


# Each lowering rule's warning, written out by hand: every one holds "is not supported with", the
# phrase vLLM's warnings share (vllm/config/compilation.py) and a log is grepped for; the three
# rules a backend's support forces name the backend and its support, as vLLM's do.
RULE_WARNINGS = [
    (
        1,
        dict(
            mode=M.FULL,
            support=S.NEVER,
            backend_name="TORCH_REF",
            attention_compiled_piecewise=False,
            enforce_eager=True,
        ),
        "CUDAGraphMode.FULL is not supported with enforce_eager=True; setting cudagraph_mode=NONE "
        "(every step runs eagerly)",
    ),
    (
        2,
        dict(mode=M.FULL, support=S.UNIFORM_BATCH, backend_name="FLASH_ATTN", attention_compiled_piecewise=True),
        "CUDAGraphMode.FULL is not supported with FLASH_ATTN backend (support: UNIFORM_BATCH); setting "
        "cudagraph_mode=FULL_AND_PIECEWISE (full graphs of mixed batches need support ALWAYS; attention is compiled "
        "piecewise)",
    ),
    (
        3,
        dict(mode=M.FULL_DECODE_ONLY, support=S.NEVER, backend_name="TORCH_REF", attention_compiled_piecewise=False),
        "CUDAGraphMode.FULL_DECODE_ONLY is not supported with TORCH_REF backend (support: NEVER); setting "
        "cudagraph_mode=NONE (no full graphs at all; attention is not compiled piecewise)",
    ),
    (
        4,
        dict(
            mode=M.FULL_DECODE_ONLY,
            support=S.UNIFORM_SINGLE_TOKEN_DECODE,
            backend_name=BACKEND,
            attention_compiled_piecewise=True,
            uniform_decode_query_len=2,
        ),
        "CUDAGraphMode.FULL_DECODE_ONLY is not supported with MY_TEST_BACKEND backend (support: "
        "UNIFORM_SINGLE_TOKEN_DECODE); setting cudagraph_mode=PIECEWISE (decode steps of 2 query tokens need support "
        "UNIFORM_BATCH; attention is compiled piecewise)",
    ),
    (
        5,
        dict(mode=M.FULL_AND_PIECEWISE, support=S.ALWAYS, backend_name=BACKEND, attention_compiled_piecewise=False),
        "CUDAGraphMode.FULL_AND_PIECEWISE is not supported with a model not split at the attention ops; setting "
        "cudagraph_mode=FULL_DECODE_ONLY (piecewise graphs need the attention ops split out, as compile=True does)",
    ),
]


@pytest.mark.parametrize(("rule", "kwargs", "message"), RULE_WARNINGS, ids=[f"rule{r[0]}" for r in RULE_WARNINGS])
def test_each_rule_warns_in_words_a_log_can_be_grepped_for(
    caplog: pytest.LogCaptureFixture, rule: int, kwargs: dict, message: str
) -> None:
    caplog.set_level(logging.WARNING, logger="pagedkv")
    args = dict(kwargs)
    resolve_cudagraph_mode(args.pop("mode"), args.pop("support"), **args)
    assert [r.getMessage() for r in caplog.records if r.name == "pagedkv"] == [message]
    args = dict(kwargs)
    (step,) = resolve_explained(args.pop("mode"), args.pop("support"), **args).steps
    assert step.rule == rule and step.message == message


def test_enforce_eager_is_announced_and_beats_the_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pagedkv")
    resolved = resolve_cudagraph_mode(
        M.FULL, S.NEVER, backend_name="TORCH_REF", attention_compiled_piecewise=False, enforce_eager=True
    )
    assert resolved is M.NONE
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "CUDAGraphMode.FULL is not supported with enforce_eager=True; setting cudagraph_mode=NONE"
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        (dict(mode="SOMETIMES"), ValueError, "Unknown cudagraph_mode 'SOMETIMES'"),
        (dict(mode=2), ValueError, "Unknown cudagraph_mode 2"),
        (dict(support="ALWAYS"), TypeError, "support must be an AttentionCGSupport"),
        (dict(backend_name=""), TypeError, "backend_name"),
        (dict(uniform_decode_query_len=0), ValueError, "uniform_decode_query_len must be >= 1"),
        (dict(uniform_decode_query_len=True), TypeError, "uniform_decode_query_len must be an int"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], needle: str) -> None:
    args = dict(mode=M.PIECEWISE, support=S.ALWAYS, backend_name=BACKEND, attention_compiled_piecewise=True)
    args.update(kwargs)
    with pytest.raises(error, match=needle):
        resolve_cudagraph_mode(args.pop("mode"), args.pop("support"), **args)


def test_the_engine_call_takes_exactly_resolve_explained_s_parameters() -> None:
    # resolve_cudagraph_mode writes its parameters out (so editors and help() show them) and forwards
    # them; this keeps the two lists from drifting: names, kinds, defaults and annotations all compared.
    engine = inspect.signature(resolve_cudagraph_mode).parameters
    explained = inspect.signature(resolve_explained).parameters
    assert list(engine.values()) == list(explained.values())


# ---- the enum itself ------------------------------------------------------------------------

# mode: (decode, mixed, has full graphs, needs piecewise compilation), by hand
ROUTINES = {
    M.NONE: (M.NONE, M.NONE, False, False),
    M.PIECEWISE: (M.PIECEWISE, M.PIECEWISE, False, True),
    M.FULL: (M.FULL, M.FULL, True, False),
    M.FULL_DECODE_ONLY: (M.FULL, M.NONE, True, False),
    M.FULL_AND_PIECEWISE: (M.FULL, M.PIECEWISE, True, True),
}


@pytest.mark.parametrize("mode", list(M))
def test_mode_routines(mode: CUDAGraphMode) -> None:
    decode, mixed, full, piecewise = ROUTINES[mode]
    assert (mode.decode_mode(), mode.mixed_mode()) == (decode, mixed)
    assert mode.has_full_cudagraphs() is full
    assert mode.requires_piecewise_compilation() is piecewise
    assert M.from_routines(decode, mixed) is mode
    assert M.parse(mode.name.lower()) is mode


def test_without_piecewise() -> None:
    expected = {
        M.NONE: M.NONE,
        M.PIECEWISE: M.NONE,
        M.FULL: M.FULL,
        M.FULL_DECODE_ONLY: M.FULL_DECODE_ONLY,
        M.FULL_AND_PIECEWISE: M.FULL_DECODE_ONLY,
    }
    assert {mode: mode.without_piecewise() for mode in M} == expected


def test_a_pair_that_is_no_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="No CUDAGraphMode runs decode batches as PIECEWISE and mixed batches as FULL"):
        M.from_routines(M.PIECEWISE, M.FULL)


def test_config_holds_the_enum_and_imports_no_higher_layer() -> None:
    """CUDAGraphMode is configuration (vllm/config/compilation.py): pagedkv.config, the lowest
    layer, defines it and imports nothing of pagedkv but the leaf argument checks."""
    import pagedkv.config

    assert pagedkv.config.CUDAGraphMode is CUDAGraphMode
    assert pagedkv.config.CompilationConfig().cudagraph_mode is CUDAGraphMode.NONE
    tree = ast.parse(Path(pagedkv.config.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {name for name in imported if name.startswith("pagedkv")} <= {"pagedkv.checks"}


@pytest.mark.parametrize("mode", [M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE])
def test_no_full_graphs_without_split_lowers_straight_to_none(caplog: pytest.LogCaptureFixture, mode: M) -> None:
    """Rule 3 of pagedkv/compilation/resolve.py: support NEVER, decode FULL -> "PIECEWISE if attention is
    compiled piecewise, else NONE". Not split: one change, announced once, FULL... -> NONE; the
    log must not claim a PIECEWISE mode the engine can never run."""
    caplog.set_level(logging.WARNING, logger="pagedkv")
    resolved = resolve_cudagraph_mode(mode, S.NEVER, backend_name="TORCH_REF", attention_compiled_piecewise=False)
    assert resolved is M.NONE
    messages = [r.getMessage() for r in caplog.records if r.name == "pagedkv"]
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        f"CUDAGraphMode.{mode.name} is not supported with TORCH_REF backend (support: NEVER); "
        "setting cudagraph_mode=NONE"
    )
