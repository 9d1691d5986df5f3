"""`CudaGraphModeExplorer` state in plain Python: controls in, resolved mode and messages out.

Expected modes are worked out by hand from the lowering rules (issue 9 point 1), not
computed by the resolver the widget calls.
"""

from __future__ import annotations

import logging
import re

import pytest

from pagedkv.attention.backend import AttentionCGSupport
from pagedkv.attention.selector import load_backend
from pagedkv.widgets import CudaGraphModeExplorer, PiecewiseSplitView

S = AttentionCGSupport


def routines(html: str, row: str) -> list[str]:
    """The (decode, mixed) routines drawn in the 'configured' or 'resolved' row."""
    match = re.search(rf'<tr class="pkv-cg-{row}">(.*?)</tr>', html)
    assert match, f"no {row} row"
    return re.findall(r'data-routine="(\w+)"', match.group(1))


def warnings(html: str) -> list[str]:
    return re.findall(r'class="pkv-cg-warning"[^>]*><b>warning</b>: (.*?)</div>', html)


@pytest.mark.parametrize(
    ("controls", "resolved", "decode_mixed", "num_warnings"),
    [
        # ALWAYS keeps every mode; FULL_AND_PIECEWISE = FULL decode graphs, piecewise mixed batches.
        (dict(mode="FULL_AND_PIECEWISE", support=S.ALWAYS), "FULL_AND_PIECEWISE", ["FULL", "PIECEWISE"], 0),
        # rule 2: mixed FULL needs ALWAYS; compiled piecewise -> mixed batches go piecewise.
        (dict(mode="FULL", support=S.UNIFORM_BATCH), "FULL_AND_PIECEWISE", ["FULL", "PIECEWISE"], 1),
        # rule 2 then rule 4: two lowerings, two warnings.
        (
            dict(mode="FULL", support=S.UNIFORM_SINGLE_TOKEN_DECODE, uniform_decode_query_len=3),
            "PIECEWISE",
            ["PIECEWISE", "PIECEWISE"],
            2,
        ),
        # rule 5: no piecewise graphs without compile=True.
        (dict(mode="PIECEWISE", support=S.ALWAYS, attention_compiled_piecewise=False), "NONE", ["NONE", "NONE"], 1),
        # rule 1.
        (dict(mode="FULL_DECODE_ONLY", support=S.ALWAYS, enforce_eager=True), "NONE", ["NONE", "NONE"], 1),
    ],
)
def test_resolved_mode_and_warnings(controls: dict, resolved: str, decode_mixed: list[str], num_warnings: int) -> None:
    explorer = CudaGraphModeExplorer(**controls)
    html = explorer.view.value
    assert f'data-resolved="{resolved}"' in html
    assert routines(html, "resolved") == decode_mixed
    assert len(warnings(html)) == num_warnings
    assert all(" is not supported with " in w and "; setting cudagraph_mode=" in w for w in warnings(html))
    assert "pkv-cg-error" not in html


def test_configured_row_shows_the_mode_as_a_pair() -> None:
    html = CudaGraphModeExplorer("FULL_DECODE_ONLY").view.value
    assert routines(html, "configured") == ["FULL", "NONE"]


def test_a_real_backend_sets_and_locks_the_support_level() -> None:
    explorer = CudaGraphModeExplorer("FULL_AND_PIECEWISE", support=S.ALWAYS)
    assert not explorer.support.disabled
    explorer.backend.value = "TORCH_REF"  # its builder loops over host-side lengths: NEVER
    assert load_backend("TORCH_REF").get_builder_cls().cudagraph_support is S.NEVER
    assert explorer.support.value == "NEVER" and explorer.support.disabled and explorer.chosen_backend == "TORCH_REF"
    html = explorer.view.value
    # rule 3: no full graph at all -> PIECEWISE (compiled piecewise), the warning names the backend.
    assert 'data-resolved="PIECEWISE"' in html
    (warning,) = warnings(html)
    assert warning.startswith(
        "CUDAGraphMode.FULL_AND_PIECEWISE is not supported with TORCH_REF backend (support: NEVER); "
        "setting cudagraph_mode=PIECEWISE"
    )
    assert "TorchRefMetadataBuilder.cudagraph_support" in html
    explorer.backend.value = "(any backend)"
    assert explorer.chosen_backend is None and not explorer.support.disabled and explorer.support.value == "NEVER"


def test_full_with_support_never_shows_the_error() -> None:
    explorer = CudaGraphModeExplorer("FULL", backend="TORCH_REF")
    html = explorer.view.value
    assert 'data-resolved="ERROR"' in html and "start-up fails" in html
    assert (
        "CUDAGraphMode.FULL is not supported with TORCH_REF backend (support: NEVER); "
        "please try cudagraph_mode=PIECEWISE" in html
    )
    assert repr(explorer) == "CudaGraphModeExplorer(FULL, TORCH_REF support NEVER, piecewise, q=1 -> ValueError)"
    explorer.enforce_eager.value = True  # rule 1 comes first: no error
    assert 'data-resolved="NONE"' in explorer.view.value and "pkv-cg-error" not in explorer.view.value


def test_every_control_redraws() -> None:
    explorer = CudaGraphModeExplorer("FULL_DECODE_ONLY", support=S.UNIFORM_SINGLE_TOKEN_DECODE)
    assert 'data-resolved="FULL_DECODE_ONLY"' in explorer.view.value
    explorer.query_len.value = 2  # rule 4 -> PIECEWISE
    assert 'data-resolved="PIECEWISE"' in explorer.view.value
    assert "2 query token(s) per request" in explorer.view.value
    explorer.piecewise.value = False  # rule 4 -> NONE without piecewise graphs
    assert 'data-resolved="NONE"' in explorer.view.value
    explorer.support.value = "UNIFORM_BATCH"
    assert 'data-resolved="FULL_DECODE_ONLY"' in explorer.view.value
    explorer.mode.value = "PIECEWISE"  # rule 5
    assert 'data-resolved="NONE"' in explorer.view.value
    assert repr(explorer) == (
        "CudaGraphModeExplorer(PIECEWISE, YOUR_BACKEND support UNIFORM_BATCH, not piecewise, q=2 -> NONE, 1 warning(s))"
    )


def test_warnings_are_shown_not_leaked(capsys: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger("pagedkv")
    handlers, level = list(logger.handlers), logger.level
    logger.setLevel(logging.ERROR)  # even a silenced logger's warnings reach the view
    try:
        explorer = CudaGraphModeExplorer("FULL", support=S.UNIFORM_BATCH)
        assert len(warnings(explorer.view.value)) == 1
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(level)
    assert logger.handlers == handlers
    assert capsys.readouterr().err == ""


def test_colours_follow_the_jupyterlab_theme() -> None:
    """No fixed colour: every colour is a --jp- theme variable, so dark themes stay readable."""
    for explorer in (
        CudaGraphModeExplorer(),
        CudaGraphModeExplorer("FULL", backend="TORCH_REF"),
        CudaGraphModeExplorer("FULL", support=S.UNIFORM_BATCH),
    ):
        html = explorer.view.value
        assert not re.search(r"#[0-9a-fA-F]{3,6}\b|(?<![\w-])(white|black|rgb)(?![\w-])", html)
        declarations = re.findall(r"\b(?:color|background|border(?:-left|-right|-top|-bottom)?)\s*:\s*([^;\"]+)", html)
        assert len(declarations) > 5
        for value in declarations:
            assert "var(--jp-" in value, value


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        (dict(mode="SOMETIMES"), ValueError, "Unknown cudagraph_mode"),
        (dict(backend="NO_SUCH"), ValueError, "backend 'NO_SUCH' is not registered"),
        (dict(support="MOSTLY"), ValueError, "support must be an AttentionCGSupport"),
        (dict(uniform_decode_query_len=0), ValueError, r"uniform_decode_query_len must be an int in \[1, 4\]"),
        (dict(uniform_decode_query_len=True), TypeError, "uniform_decode_query_len must be an int"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=needle):
        CudaGraphModeExplorer(**kwargs)


# ---- PiecewiseSplitView -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled_tiny():
    """The 4-layer tiny model compiled piecewise on the CPU (eager pieces) after one generate."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.compilation import compile_model

    llm = LLM("tiny", device="cpu", num_kv_blocks=16)
    llm.config.compilation_config.piece_compiler = "eager"
    compiled = compile_model(llm.runner.model, llm.config)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=2))
    return compiled


def test_split_view_draws_pieces_and_eager_ops_in_order(compiled_tiny) -> None:
    html = PiecewiseSplitView(compiled_tiny.backend).value
    boxes = re.findall(r'class="pkv-(piece|split-op)" data-\w+="([^"]+)" data-\w+="([^"]+)"', html)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    expected = [("piece", "0", "0")]
    for i, layer in enumerate(layers):  # per layer: cache write, attention, then the piece after it
        expected += [
            ("split-op", "unified_kv_cache_update", layer),
            ("split-op", "unified_attention_with_output", layer),
        ]
        # the pieces between layers are one graph, compiled once (#1); the last one differs (#2)
        expected.append(("piece", str(i + 1), "1" if i < 3 else "2"))
    assert boxes == expected
    assert "compiled #1, shared by 3 pieces" in html and "Dynamo graphs: 1" in html
    view = PiecewiseSplitView(compiled_tiny.backend)
    assert repr(view) == "PiecewiseSplitView(5 pieces, 3 compiled, 8 splitting ops)"
    assert not re.search(r"#[0-9a-fA-F]{3,6}\b|(?<![\w-])(white|black)(?![\w-])", html)


def test_split_view_needs_a_traced_model() -> None:
    from pagedkv.compilation import PiecewiseBackend

    with pytest.raises(ValueError, match="has not traced the model yet"):
        PiecewiseSplitView(PiecewiseBackend(["pagedkv::unified_attention_with_output"], "eager"))


def test_split_view_names_what_it_wants_when_given_the_wrapper(compiled_tiny) -> None:
    with pytest.raises(TypeError, match="the `backend` of a CompiledForward; got CompiledForward .pass its .backend"):
        PiecewiseSplitView(compiled_tiny)


def test_messages_are_in_the_text_colour_and_the_controls_wrap() -> None:
    """JupyterLab Light's warn-color1 (#f57c00) is 2.7:1 on white: messages keep the text colour and
    carry the warning / error colour as a bar; the control rows wrap instead of squeezing the
    support dropdown (cut to "UNIFORM_SINGLE_T" in an ~850 px output area)."""
    explorer = CudaGraphModeExplorer("FULL", support=S.UNIFORM_BATCH)
    html = explorer.view.value
    (warning,) = re.findall(r'<div class="pkv-cg-warning" style="([^"]*)"', html)
    assert "border-left: 4px solid var(--jp-warn-color1" in warning and "color:" not in warning.replace("-color1", "")
    error = CudaGraphModeExplorer("FULL", support=S.NEVER, attention_compiled_piecewise=False).view.value
    assert re.search(r'<div class="pkv-cg-error" style="[^"]*border-left: 4px solid var\(--jp-error-color1', error)
    for row in explorer.children[:2]:
        assert row.layout.flex_flow == "row wrap"
