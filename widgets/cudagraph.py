"""Notebook 08's views: CUDA graph modes and the piecewise split.

`CudaGraphModeExplorer`: choose a CUDA graph mode and a backend's support, see what runs.
The verdict comes from the engine's own rules (`pagedkv.compilation.resolve.resolve_explained`,
which `resolve_cudagraph_mode` wraps, with the warnings it would log), so the widget can never
disagree with what `LLM` would do at start-up.

`PiecewiseSplitView`: the pieces of a model compiled by `compile_model`, and the attention ops
run eagerly between them.

Colours are JupyterLab theme variables (`--jp-...`), so the view reads in light and dark themes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ipywidgets

from pagedkv.attention.backend import AttentionCGSupport
from pagedkv.attention.selector import load_backend, registered_backends
from pagedkv.checks import check_int
from pagedkv.compilation.resolve import Resolution, resolve_explained
from pagedkv.config import CUDAGraphMode
from pagedkv.widgets.common import BASE_STYLE, esc, short_layer

if TYPE_CHECKING:
    from pagedkv.compilation.backend import PiecewiseBackend

ANY_BACKEND = "YOUR_BACKEND"
"""The backend named in messages when only a support level is chosen."""
ANY_CHOICE = "(any backend)"
"""The backend control's entry for "no real backend: I choose the support level"."""
ROUTINES = {
    CUDAGraphMode.FULL: ("one FULL graph", "var(--jp-brand-color1, currentColor)"),
    CUDAGraphMode.PIECEWISE: ("piecewise graphs, attention eager", "var(--jp-accent-color1, currentColor)"),
    CUDAGraphMode.NONE: ("eager", "var(--jp-border-color1, currentColor)"),
}
"""Runtime routine -> (what a step does, the colour of its marker)."""
TEXT = "color: var(--jp-ui-font-color1, inherit); background: var(--jp-layout-color1, transparent)"
MARK = "margin: 2px 0; padding-left: 6px; border-left: 4px solid "
"""A message's style up to its bar's colour."""
CELL = "padding: 3px 8px; border: 1px solid var(--jp-border-color2, currentColor); text-align: left"
SUPPORT_LEVELS = sorted(AttentionCGSupport, key=lambda s: s.value, reverse=True)


def _support(value: AttentionCGSupport | str) -> AttentionCGSupport:
    if isinstance(value, AttentionCGSupport):
        return value
    if isinstance(value, str) and value.upper() in AttentionCGSupport.__members__:
        return AttentionCGSupport[value.upper()]
    names = [s.name for s in SUPPORT_LEVELS]
    raise ValueError(f"support must be an AttentionCGSupport or one of {names}, got {value!r}.")


def builder_support(backend: str) -> AttentionCGSupport:
    """The `cudagraph_support` a registered backend's metadata builder declares."""
    return load_backend(backend).get_builder_cls().cudagraph_support


def _routine(mode: CUDAGraphMode) -> str:
    label, color = ROUTINES[mode]
    return (
        f'<span class="pkv-cg-routine" data-routine="{mode.name}" style="border-left: 5px solid {color}; '
        f'padding: 0 6px">{esc(label)}</span>'
    )


def _mode_row(kind: str, mode: CUDAGraphMode | None) -> str:
    if mode is None:
        cells = '<td colspan="3"><b>none: start-up fails (ValueError below)</b></td>'
    else:
        routines = "".join(f"<td>{_routine(r)}</td>" for r in (mode.decode_mode(), mode.mixed_mode()))
        cells = f"<td><b>{mode.name}</b></td>{routines}"
    cells = cells.replace("<td", f'<td style="{CELL}"')
    return f'<tr class="pkv-cg-{kind}"><td style="{CELL}">{kind}</td>{cells}</tr>'


class CudaGraphModeExplorer(ipywidgets.VBox):
    """Controls for every input of `resolve_cudagraph_mode`, and its verdict redrawn on each change.

    Pick a registered backend to use the support its builder declares (the support control is
    then locked), or "any backend" to set the support level yourself. The view shows the
    configured and the resolved mode as (decode, mixed) routines, every warning the resolver
    logged (one per change, in rule order), or the ValueError that would stop start-up.
    """

    def __init__(
        self,
        mode: CUDAGraphMode | str = CUDAGraphMode.FULL_AND_PIECEWISE,
        *,
        backend: str | None = None,
        support: AttentionCGSupport | str = AttentionCGSupport.ALWAYS,
        attention_compiled_piecewise: bool = True,
        uniform_decode_query_len: int = 1,
        enforce_eager: bool = False,
        **kwargs: Any,
    ) -> None:
        if backend is not None and backend not in registered_backends():
            raise ValueError(f"backend {backend!r} is not registered; use None or one of {registered_backends()}.")
        check_int("uniform_decode_query_len", uniform_decode_query_len, 1, 4, hint=" (the slider's range)")

        def sized(width: str) -> dict[str, Any]:
            return {"style": {"description_width": "initial"}, "layout": ipywidgets.Layout(width=width)}

        self.mode = ipywidgets.Dropdown(
            options=[m.name for m in CUDAGraphMode],
            value=CUDAGraphMode.parse(mode).name,
            description="cudagraph_mode",
            **sized("300px"),
        )
        self.backend = ipywidgets.Dropdown(
            options=[ANY_CHOICE, *registered_backends()],
            value=backend or ANY_CHOICE,
            description="backend",
            **sized("230px"),
        )
        self.support = ipywidgets.Dropdown(
            options=[s.name for s in SUPPORT_LEVELS],
            value=_support(support).name,
            description="builder's cudagraph_support",
            **sized("480px"),
        )
        self.query_len = ipywidgets.IntSlider(
            value=uniform_decode_query_len,
            min=1,
            max=4,
            description="decode query tokens per request",
            **sized("400px"),
        )
        self.piecewise = ipywidgets.Checkbox(
            value=attention_compiled_piecewise,
            indent=False,
            description="attention compiled piecewise (compile=True)",
            layout=ipywidgets.Layout(width="auto"),
        )
        self.enforce_eager = ipywidgets.Checkbox(
            value=enforce_eager, indent=False, description="enforce_eager", layout=ipywidgets.Layout(width="auto")
        )
        self.view = ipywidgets.HTML()
        # Rows that wrap: at a 1280 px window with the file browser open the output area is ~850 px,
        # less than the three dropdowns; a row that cannot wrap squeezes the last one's choice.
        wrap = ipywidgets.Layout(flex_flow="row wrap", max_width="100%")
        controls = [
            ipywidgets.HBox([self.mode, self.backend, self.support], layout=wrap),
            ipywidgets.HBox([self.query_len, self.piecewise, self.enforce_eager], layout=wrap),
        ]
        super().__init__([*controls, self.view], **kwargs)
        self.add_class("pkv-cudagraph-explorer")
        self.backend.observe(lambda _change: self._use_backend(), "value")
        for control in (self.mode, self.support, self.piecewise, self.query_len, self.enforce_eager):
            control.observe(lambda _change: self.redraw(), "value")
        self._use_backend()

    @property
    def chosen_backend(self) -> str | None:
        """The registered backend picked in the control, None for "any backend"."""
        return None if self.backend.value == ANY_CHOICE else self.backend.value

    @property
    def backend_name(self) -> str:
        """The name the resolver's messages use."""
        return self.chosen_backend or ANY_BACKEND

    @property
    def resolution(self) -> Resolution:
        """What `resolve_cudagraph_mode` makes of the current controls."""
        return resolve_explained(
            self.mode.value,
            AttentionCGSupport[self.support.value],
            backend_name=self.backend_name,
            attention_compiled_piecewise=self.piecewise.value,
            uniform_decode_query_len=self.query_len.value,
            enforce_eager=self.enforce_eager.value,
        )

    def _use_backend(self) -> None:
        """A real backend fixes the support level to its builder's; "any backend" frees it."""
        name = self.chosen_backend
        self.support.disabled = name is not None
        if name is not None and self.support.value != builder_support(name).name:
            self.support.value = builder_support(name).name  # its observer redraws
        else:
            self.redraw()

    def redraw(self) -> None:
        self.view.value = self.render(self.resolution)

    def render(self, result: Resolution) -> str:
        source = (
            f"{self.backend_name}: {load_backend(self.backend_name).get_builder_cls().__name__}.cudagraph_support"
            if self.chosen_backend
            else f"{ANY_BACKEND}: the level chosen above"
        )
        header = "".join(
            f'<th style="{CELL}">{esc(h)}</th>'
            for h in (
                "",
                "mode",
                f"decode batches ({self.query_len.value} query token(s) per request)",
                "mixed batches (prefills, chunks, mixed)",
            )
        )
        # Messages in the text colour, marked by a bar in the error / warning colour: JupyterLab
        # Light's warn-color1 (#f57c00) is 2.7:1 on white, too pale for text.
        if result.error:
            messages = (
                f'<div class="pkv-cg-error" style="{MARK}var(--jp-error-color1, red)">'
                f"<b>ValueError</b>: {esc(result.error)}</div>"
            )
        elif result.warnings:
            messages = "".join(
                f'<div class="pkv-cg-warning" style="{MARK}var(--jp-warn-color1, orange)">'
                f"<b>warning</b>: {esc(w)}</div>"
                for w in result.warnings
            )
        else:
            messages = '<div class="pkv-cg-ok">no warning: the configured mode runs as it is.</div>'
        resolved = result.resolved.name if result.resolved else "ERROR"
        return (
            f'<div class="pkv-cudagraph" data-resolved="{resolved}" style="{BASE_STYLE}; {TEXT}; padding: 4px">'
            f"<div>support {self.support.value} ({esc(source)}), the weakest over all attention groups</div>"
            f'<table style="border-collapse: collapse; margin: 4px 0">'
            f"<tr>{header}</tr>{_mode_row('configured', result.configured)}{_mode_row('resolved', result.resolved)}"
            f"</table>{messages}</div>"
        )

    def __repr__(self) -> str:
        result = self.resolution
        flags = [
            "piecewise" if self.piecewise.value else "not piecewise",
            f"q={self.query_len.value}",
            *(["enforce_eager"] if self.enforce_eager.value else []),
        ]
        outcome = "ValueError" if result.error else f"{result.resolved.name}, {len(result.warnings)} warning(s)"
        return (
            f"CudaGraphModeExplorer({self.mode.value}, {self.backend_name} support {self.support.value}, "
            f"{', '.join(flags)} -> {outcome})"
        )


# ---- the piecewise split of a compiled model ------------------------------------------------

PIECE_COLORS = (
    "var(--jp-brand-color1, currentColor)",
    "var(--jp-accent-color1, currentColor)",
    "var(--jp-warn-color1, currentColor)",
    "var(--jp-error-color1, currentColor)",
)
"""Border colour per distinct compiled piece: pieces drawn alike share one compiled callable."""
OP_LABELS = {
    "unified_kv_cache_update": "KV cache write",
    "unified_attention_with_output": "attention",
    "unified_mla_kv_cache_update": "MLA cache write",
    "unified_mla_attention_with_output": "MLA attention",
}
BOX = "display: inline-block; vertical-align: top; margin: 2px; padding: 3px 6px; border-radius: 4px"


def _calls(graph: Any, kinds: tuple[str, ...] = ("call_function",)) -> list[Any]:
    return [node for node in graph.graph.nodes if node.op in kinds]


def _piece_box(index: int, name: str, graph: Any, compiled_id: int, shared_by: int) -> str:
    calls = _calls(graph, ("call_function", "call_method"))
    names = [getattr(node.target, "__name__", str(node.target)) for node in calls]
    counts = ", ".join(f"{names.count(n)} {n}" for n in ("embedding", "linear") if n in names)
    shared = f", shared by {shared_by} pieces" if shared_by > 1 else ""
    return (
        f'<div class="pkv-piece" data-piece="{index}" data-compiled="{compiled_id}" style="{BOX}; '
        f'border: 2px solid {PIECE_COLORS[compiled_id % len(PIECE_COLORS)]}">'
        f"<b>piece {index}</b> <small>{esc(name)}</small><br>{len(names)} ops: {esc(counts)}<br>"
        f"compiled #{compiled_id}{shared}</div>"
    )


def _op_box(graph: Any) -> str:
    (node,) = _calls(graph)
    op = OP_LABELS.get(node.target.__name__, node.target.__name__)
    layer = short_layer(str(node.args[-1]))
    return (
        f'<div class="pkv-split-op" data-op="{esc(node.target.__name__)}" data-layer="{esc(node.args[-1])}" '
        f'style="{BOX}; border: 1px dashed var(--jp-border-color1, currentColor)">'
        f"{esc(op)}<br>{esc(layer)}<br><i>eager</i></div>"
    )


class PiecewiseSplitView(ipywidgets.HTML):
    """The split graph of a model compiled by `compile_model`, in execution order.

    Solid boxes are the compiled pieces (one colour per distinct compiled callable: the
    pieces between two layers are the same graph, compiled once); dashed boxes are the
    splitting ops, which run eagerly between them. Give it `CompiledForward.backend` after
    the first forward of at least 2 tokens (that call traces the model).
    """

    def __init__(self, backend: PiecewiseBackend, **kwargs: Any) -> None:
        from pagedkv.compilation.backend import PiecewiseBackend  # torch.fx: only when a split is drawn

        if not isinstance(backend, PiecewiseBackend):
            hint = " (pass its .backend)" if isinstance(getattr(backend, "backend", None), PiecewiseBackend) else ""
            raise TypeError(
                f"PiecewiseSplitView draws a PiecewiseBackend, the `backend` of a CompiledForward; "
                f"got {type(backend).__name__}{hint}."
            )
        if not backend.items:
            raise ValueError(
                "The backend has not traced the model yet: run one forward of at least 2 tokens "
                "(e.g. llm.generate(...)) before drawing its split."
            )
        super().__init__(**kwargs)
        self.backend = backend
        self.value = self.render()

    def _compiled_ids(self) -> list[int]:
        """Per piece, a small number per distinct compiled callable, in order of appearance."""
        ids: dict[int, int] = {}
        return [ids.setdefault(id(piece.runnable), len(ids)) for piece in self.backend.pieces]

    def render(self) -> str:
        compiled = self._compiled_ids()
        boxes, index = [], 0
        for item in self.backend.items:
            if item.is_splitting_op:
                boxes.append(_op_box(item.graph))
            else:
                boxes.append(_piece_box(index, item.name, item.graph, compiled[index], compiled.count(compiled[index])))
                index += 1
        return (
            f'<div class="pkv-split" style="{BASE_STYLE}; {TEXT}; padding: 4px">'
            f"<div>{len(self.backend.pieces)} compiled pieces ({len(set(compiled))} distinct compilations), "
            f"{len(self.backend.items) - len(self.backend.pieces)} splitting ops run eagerly; "
            f"Dynamo graphs: {self.backend.num_graphs}</div>{''.join(boxes)}</div>"
        )

    def __repr__(self) -> str:
        compiled = self._compiled_ids()
        ops = len(self.backend.items) - len(self.backend.pieces)
        return f"PiecewiseSplitView({len(compiled)} pieces, {len(set(compiled))} compiled, {ops} splitting ops)"
