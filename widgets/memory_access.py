"""`MemoryAccessView`: which cells of each tensor a Triton kernel's programs loaded and stored.

Draws an `AccessLog` of `pagedkv.exercises.memory_access.record_accesses`, as Triton-Puzzles draws
its puzzles: one grid of cells per tensor, loaded cells in one colour, stored cells in another,
and accesses outside every tensor flagged under the tensor they came nearest to.
"""

from __future__ import annotations

import math
from typing import Any

import ipywidgets
import numpy as np

from pagedkv.exercises.memory_access import (
    Access,
    AccessLog,
    KernelLaunch,
    Program,
    TensorInfo,
    count_text,
    where_outside,
)
from pagedkv.widgets.common import BASE_STYLE, BG, BORDER_LIGHT, FG_MUTED, PALETTE, SVG_STYLE, dropdown_size, esc

LOAD_COLOR, STORE_COLOR = PALETTE[0], PALETTE[1]
"""Blue and vermilion (Okabe-Ito): told apart with every common colour vision deficiency, each >= 3:1
against both JupyterLab backgrounds. Text is never drawn in them."""
OUTSIDE_COLOR = "var(--jp-error-color1, #d32f2f)"
"""Frames and cells only: as text, the dark theme's error red is below 4.5:1 on its background."""
MAX_WIDTH, MAX_HEIGHT = 900, 320
"""The grid of one tensor, in px (the labels take the rest of a 1000 px column)."""
MIN_CELL, MAX_CELL = 4, 14
WRAP = 64
"""A 1-D tensor is drawn in rows of this many elements."""
ALL = -1
"""The program picker's value for every program of the launch together."""
OPS_LISTED = 24


def _cells(info: TensorInfo, hit: np.ndarray) -> tuple[np.ndarray, str, int]:
    """The share of each cell's elements that `hit` marks (NaN: no element), what one cell is, and how
    many elements of the first dimension one row of cells spans (1-D tensors wrap)."""
    shape = info.shape
    if len(shape) == 0:
        return hit.reshape(1, 1).astype(float), "a cell = the element", 1
    if len(shape) == 1:
        n = shape[0]
        cols = min(max(n, 1), WRAP)
        grid = np.full(cols * max(math.ceil(n / cols), 1), np.nan)
        grid[:n] = hit
        return grid.reshape(-1, cols), "a cell = one element", cols
    if len(shape) == 2:
        return hit.astype(float), "a cell = one element", 1
    rest = int(np.prod(shape[2:]))
    grid = hit.reshape(shape[0], shape[1], rest).mean(axis=2) if rest else np.full(shape[:2], np.nan)
    stars = ", ".join([":"] * (len(shape) - 2))
    return grid, f"a cell = {info.name}[i, j, {stars}] ({rest} elements)", 1


def _shrink(grid: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Cells merged in blocks of (rows, cols) so the grid fits MAX_WIDTH x MAX_HEIGHT at MIN_CELL px."""
    rows, cols = grid.shape
    rg, cg = max(math.ceil(rows * MIN_CELL / MAX_HEIGHT), 1), max(math.ceil(cols * MIN_CELL / MAX_WIDTH), 1)
    if rg == cg == 1:
        return grid, 1, 1
    padded = np.full((math.ceil(rows / rg) * rg, math.ceil(cols / cg) * cg), np.nan)
    padded[:rows, :cols] = grid
    blocks = padded.reshape(padded.shape[0] // rg, rg, padded.shape[1] // cg, cg)
    empty = np.isnan(blocks).all(axis=(1, 3))
    merged = np.where(empty, np.nan, np.nanmean(np.where(np.isnan(blocks), 0, blocks), axis=(1, 3)))
    return merged, rg, cg


def _svg(info: TensorInfo, loaded: np.ndarray, stored: np.ndarray) -> tuple[str, str]:
    """The tensor's grid as SVG, and what one cell of it is."""
    load_grid, what, row_span = _cells(info, loaded)
    store_grid, _, _ = _cells(info, stored)
    load_grid, rg, cg = _shrink(load_grid)
    store_grid, _, _ = _shrink(store_grid)
    if rg > 1 or cg > 1:
        what += f"; merged {rg} x {cg} to fit"
    rows, cols = load_grid.shape
    cell = int(max(MIN_CELL, min(MAX_CELL, MAX_WIDTH // cols, MAX_HEIGHT // rows)))
    label_w, top = 34, 5  # room for the row labels on the left, and for half a label above the first row
    every = max(math.ceil(11 / cell), 1)  # row labels at least 11 px apart
    parts = []
    for r in range(0, rows, every):
        y = top + r * cell + cell / 2 + 3.5
        parts.append(
            f'<text x="{label_w - 4}" y="{y:.1f}" text-anchor="end" font-size="9" '
            f'style="fill:{FG_MUTED}">{r * rg * row_span}</text>'
        )
    parts.append(
        f'<rect x="{label_w}" y="{top}" width="{cols * cell}" height="{rows * cell}" '
        f'style="fill:url(#pkv-ma-cell-{cell}); stroke:{BORDER_LIGHT}"/>'
    )
    inset = cell / 4
    edge = f"stroke:{BG}; stroke-width:0.5"  # neighbouring filled cells stay told apart
    for r, c in zip(*np.nonzero(np.nan_to_num(load_grid) + np.nan_to_num(store_grid))):
        fl, fs = float(np.nan_to_num(load_grid[r, c])), float(np.nan_to_num(store_grid[r, c]))
        x, y = label_w + c * cell, top + r * cell
        pad = 0 if max(fl, fs) >= 1 else inset  # a cell only partly touched: a smaller square
        size = cell - 2 * pad
        kind = "both" if fl and fs else "load" if fl else "store"
        if kind == "both":
            parts.append(
                f'<rect class="pkv-ma-load" x="{x + pad:.1f}" y="{y + pad:.1f}" width="{size / 2:.1f}" '
                f'height="{size:.1f}" style="fill:{LOAD_COLOR}; {edge}"/>'
                f'<rect class="pkv-ma-store" x="{x + pad + size / 2:.1f}" y="{y + pad:.1f}" '
                f'width="{size / 2:.1f}" height="{size:.1f}" style="fill:{STORE_COLOR}; {edge}"/>'
            )
        else:
            color = LOAD_COLOR if kind == "load" else STORE_COLOR
            parts.append(
                f'<rect class="pkv-ma-{kind}" x="{x + pad:.1f}" y="{y + pad:.1f}" width="{size:.1f}" '
                f'height="{size:.1f}" style="fill:{color}; {edge}"/>'
            )
    width, height = label_w + cols * cell + 1, top + rows * cell + top
    pattern = (
        f'<defs><pattern id="pkv-ma-cell-{cell}" x="{label_w}" y="{top}" width="{cell}" height="{cell}" '
        f'patternUnits="userSpaceOnUse"><rect width="{cell}" height="{cell}" '
        f'style="fill:{BG}; stroke:{BORDER_LIGHT}; stroke-width:0.5"/></pattern></defs>'
    )
    svg = (
        f'<svg class="pkv-ma-grid" data-tensor="{esc(info.name)}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" style="max-width:100%; {SVG_STYLE}" '
        f'xmlns="http://www.w3.org/2000/svg">{pattern}{"".join(parts)}</svg>'
    )
    return svg, what


def _swatch(fill: str, partial: bool = False) -> str:
    """A legend key: a cell, filled (`fill`, a CSS background) whole or, `partial`, in its middle."""
    size, margin = (6, 2) if partial else (10, 0)
    return (
        f'<span style="display:inline-block; width:12px; height:12px; vertical-align:middle; '
        f'border:1px solid {BORDER_LIGHT}; background:{BG}; box-sizing:border-box">'
        f'<span style="display:block; width:{size}px; height:{size}px; margin:{margin}px; '
        f'background:{fill}"></span></span>'
    )


LEGEND = (
    f'<div class="pkv-ma-legend" style="margin: 2px 0 6px 0">{_swatch(LOAD_COLOR)} loaded &nbsp; '
    f"{_swatch(STORE_COLOR)} stored &nbsp; "
    f"{_swatch(f'linear-gradient(to right, {LOAD_COLOR} 50%, {STORE_COLOR} 50%)')} both &nbsp; "
    f"{_swatch(LOAD_COLOR, partial=True)} part of the cell &nbsp; "
    f"{_swatch(OUTSIDE_COLOR)} outside every tensor (listed under the nearest one)</div>"
)


LABEL_PX = 60
"""Width of a picker's description ("launch", "program")."""


def _span_text(info: TensorInfo, offsets: np.ndarray) -> str:
    """'src[1, 0] .. src[1, 3]' for the elements an access touched (first and last in flat order)."""
    low, high = int(offsets.min()), int(offsets.max())
    return info.describe(low) if low == high else f"{info.describe(low)} .. {info.describe(high)}"


class MemoryAccessView(ipywidgets.HTML):
    """One launch of an `AccessLog`: per program id (or all together), each tensor as a grid of cells.

    A 2-D tensor is drawn element by element; a tensor of more dimensions as its first two (a
    cell of k_cache [blocks, page, head] is one key slot, filled as far as its elements were
    touched); a 1-D one in rows of 64. Grids too large for the column merge cells. Accesses
    outside every tensor are framed in red under the tensor they came nearest to. With one
    program picked, its memory instructions are listed in program order below the grids.
    `launch` indexes `log.launches` (-1: the last); `program` is a program id (x, y, z), an int
    for a 1-D grid's program, or None for every program of the launch.
    """

    def __init__(
        self, log: AccessLog, *, launch: int = -1, program: Program | int | None = None, **kwargs: Any
    ) -> None:
        if not isinstance(log, AccessLog):
            raise TypeError(f"MemoryAccessView draws an AccessLog (from record_accesses), got {type(log).__name__}")
        if not log.launches:
            raise ValueError("the AccessLog holds no launch: launch a @triton.jit kernel inside record_accesses")
        if not -len(log.launches) <= launch < len(log.launches):
            raise IndexError(
                f"launch {launch} is out of range for {len(log.launches)} launches: "
                f"use 0..{len(log.launches) - 1}, or -1 for the last"
            )
        super().__init__(**kwargs)
        self.access_log = log
        self.add_class("pkv-memory-access")
        options = [(f"{i}: {run.kernel}, grid {run.grid[: run.dims]}", i) for i, run in enumerate(log.launches)]
        self.launch_picker = ipywidgets.Dropdown(
            options=options,
            value=launch % len(log.launches),
            description="launch",
            **dropdown_size(max(len(text) for text, _ in options), LABEL_PX),
        )
        longest = max(len(log.launches[i].program_text(log.launches[i].programs()[-1])) for _, i in options)
        self.program_picker = ipywidgets.Dropdown(
            description="program", **dropdown_size(max(longest, len("all programs")), LABEL_PX)
        )
        self._filling = False
        self._fill_programs(program)
        self.launch_picker.observe(lambda _change: self._fill_programs(None), "value")
        self.program_picker.observe(lambda _change: self._filling or self.redraw(), "value")

    @property
    def run(self) -> KernelLaunch:
        return self.access_log.launches[self.launch_picker.value]

    @property
    def program(self) -> Program | None:
        """The program on display, None for all of them."""
        index = self.program_picker.value
        return None if index == ALL else self.run.programs()[index]

    @property
    def controls(self) -> tuple[ipywidgets.Widget, ...]:
        """The pickers drawn above the grids: the launch (only when there are several) and the program."""
        several = len(self.access_log.launches) > 1
        return (self.launch_picker, self.program_picker) if several else (self.program_picker,)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return ipywidgets.VBox([ipywidgets.HBox(list(self.controls)), self])._repr_mimebundle_(**kwargs)

    def _fill_programs(self, program: Program | int | None) -> None:
        programs = self.run.programs()
        index = ALL
        if program is not None:
            wanted = (program, 0, 0) if isinstance(program, int) else tuple(program) + (0,) * (3 - len(program))
            if wanted not in programs:
                raise ValueError(f"program {program} is not in the grid {self.run.grid} of {self.run.kernel}")
            index = programs.index(wanted)
        options = [("all programs", ALL)] + [(self.run.program_text(p), i) for i, p in enumerate(programs)]
        self._filling = True  # one drawing for the new options and value, not one per change
        try:
            self.program_picker.options = options
            self.program_picker.value = index
        finally:
            self._filling = False
        self.redraw()

    def redraw(self) -> None:
        self.value = self.render()

    def _tensors(self) -> list[TensorInfo]:
        """The named tensors, the launch's arguments and anything it touched, in the log's order."""
        used = set(self.access_log.named) | set(self.run.args.values()) | {a.tensor for a in self.run.accesses}
        return [info for name, info in self.access_log.tensors.items() if name in used]

    def render(self) -> str:
        run, program, launch = self.run, self.program, self.launch_picker.value
        who = "all programs" if program is None else run.program_text(program)
        accesses = run.accesses if program is None else run.of(program)
        head = (
            f"<div><b>{esc(run.kernel)}</b>, grid {run.grid[: run.dims]}: {esc(who)}, "
            f"{sum(a.kind == 'load' for a in accesses)} loads, {sum(a.kind == 'store' for a in accesses)} "
            f"stores{' (an instruction on several tensors counts once per tensor)' if program is None else ''}"
            "</div>"
        )
        boxes = [self._tensor_box(info, program, launch, accesses) for info in self._tensors()]
        ops = self._op_list(accesses) if program is not None else ""
        return f'<div class="pkv-ma" style="{BASE_STYLE}; padding: 4px">{head}{LEGEND}{"".join(boxes)}{ops}</div>'

    def _tensor_box(self, info: TensorInfo, program: Program | None, launch: int, accesses: list[Access]) -> str:
        loaded = self.access_log.touched(info.name, "load", program, launch)
        stored = self.access_log.touched(info.name, "store", program, launch)
        svg, what = _svg(info, loaded, stored)
        outside = [a for a in accesses if a.tensor == info.name and not a.inside]
        flags = "".join(
            f'<div class="pkv-ma-outside" style="border-left: 4px solid {OUTSIDE_COLOR}; padding-left: 4px; '
            f'margin-top: 2px">&#x2717; {kind}s: {esc(where_outside(info, np.unique(np.concatenate(offs))))}</div>'
            for kind, offs in _by_kind(outside).items()
        )
        frame = OUTSIDE_COLOR if outside else BORDER_LIGHT
        args = [p for p, name in self.run.args.items() if name == info.name]
        given = f" &middot; passed as {esc(', '.join(args))}" if args else " &middot; not a kernel argument"
        caption = (
            f"<div><b>{esc(info.name)}</b> {list(info.shape)} {esc(info.dtype)}{given} &middot; "
            f'<span style="color:{FG_MUTED}">{esc(what)}; {count_text(int(loaded.sum()))} loaded, '
            f"{int(stored.sum())} stored</span></div>"
        )
        return (
            f'<div class="pkv-ma-tensor" data-tensor="{esc(info.name)}" data-outside="{len(outside)}" '
            f'style="border: 1px solid {frame}; border-radius: 3px; padding: 3px 5px; margin: 4px 0; '
            f'max-width: 960px; box-sizing: border-box; overflow-x: auto">{caption}{svg}{flags}</div>'
        )

    def _op_list(self, accesses: list[Access]) -> str:
        lines = []
        for a in accesses[:OPS_LISTED]:
            info = self.access_log.tensors[a.tensor]
            where = _span_text(info, a.offsets) if a.inside else f"OUTSIDE: {where_outside(info, a.offsets)}"
            lines.append(
                f"<li>op {a.op}: {a.kind}{' (atomic)' if a.atomic else ''} {count_text(a.offsets.size)}, "
                f"{esc(where)}</li>"
            )
        more = (
            f'<div style="color:{FG_MUTED}">... {len(accesses) - OPS_LISTED} more</div>'
            if len(accesses) > OPS_LISTED
            else ""
        )
        return (
            f'<div class="pkv-ma-ops" style="margin-top: 4px">memory instructions of this program, in order:'
            f'<ol style="margin: 2px 0; padding-left: 24px">{"".join(lines)}</ol>{more}</div>'
        )

    def __repr__(self) -> str:
        run, program = self.run, self.program
        who = "all programs" if program is None else run.program_text(program)
        return (
            f"MemoryAccessView({run.kernel}, grid {run.grid[: run.dims]}, {who}, "
            f"tensors {', '.join(info.name for info in self._tensors())})"
        )


def _by_kind(accesses: list[Access]) -> dict[str, list[np.ndarray]]:
    kinds: dict[str, list[np.ndarray]] = {}
    for a in accesses:
        kinds.setdefault(a.kind, []).append(a.offsets)
    return kinds
