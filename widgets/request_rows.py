"""`RequestRowsView`: the model runner's persistent request rows on a live engine, step by step.

Model Runner V2's shape (pagedkv/worker/states.py, vllm/v1/worker/gpu/states.py): a request holds
one row of the runner's device tensors from admission until it finishes or is preempted; each step
the host sends only which rows run and how many tokens each (`StepSchedule`), and the step's inputs
are gathered from the rows on the device (pagedkv/worker/prepare_inputs.py). The view records,
after every step, which request held which row, which rows were given back and handed out, what
each held row contains, and what the step gathered: per token its row, position, input id and
slot. A slider (and a play button) goes back to any recorded step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ipywidgets
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from pagedkv.checks import check_int
from pagedkv.widgets.common import (
    BASE_STYLE,
    BG_HEADER,
    BORDER,
    FG_MUTED,
    FIT_CSS,
    MIN_FRAME_S,
    LiveRedraw,
    esc,
    request_color,
    slider_position,
)
from pagedkv.widgets.figure import themed_figure_html

if TYPE_CHECKING:
    from pagedkv.engine.events import StepEvent
    from pagedkv.engine.llm import LLM


@dataclass(frozen=True)
class GatheredToken:
    """One token of a step's inputs, as `prepare_inputs` gathered it from the rows."""

    req_id: str
    row: int
    """The request's row: `StepSchedule.rows` (MRV2's idx_mapping) for its request."""
    position: int
    """num_computed + its index among the request's tokens this step."""
    token_id: int
    """token_ids[row, position]."""
    slots: tuple[int, ...]
    """Per KV cache group: block_tables[g][row, position // B] * B + position % B."""


@dataclass(frozen=True)
class RowsStep:
    """The request rows during one step, and what the step gathered from them (plain values)."""

    step: int
    holders: dict[int, str]
    """Row -> the request holding it during the step."""
    given_back: dict[int, str]
    """Rows given back before the step (finished, aborted or preempted since the last one) -> their request."""
    handed_out: dict[int, str]
    """Rows a request got in this step (new, or readmitted after a preemption) -> the request."""
    contents: dict[int, list[int]]
    """Row -> the token ids it holds at positions 0, 1, ... (as far as its request's tokens reach)."""
    schedule: list[tuple[str, int, int, int]]
    """What the host sent, per request in batch order: (request, row, num_computed, query_len)."""
    gathered: list[GatheredToken]
    finished: list[str]
    """Requests that finished in the step: their rows are given back at the start of the next one."""

    @property
    def rows_sent(self) -> list[int]:
        return [row for _, row, _, _ in self.schedule]


def rows_step(event: StepEvent, before: dict[int, str], extents: dict[str, int]) -> RowsStep:
    """Read one step's rows off a `StepEvent` (inside the listener: the runner's state is the step's).

    `before` is the rows held in the previous step recorded; `extents` (request -> how many
    tokens its row holds) is brought up to date for the requests of this step.
    """
    states = event.runner.states
    batch = event.result.batch
    holders = {row: req_id for req_id, row in states.row_of.items()}
    given_back = {row: r for row, r in before.items() if r in event.scheduler_output.freed_req_ids}
    handed_out = {row: r for row, r in holders.items() if before.get(row) != r}
    n, num_tokens = len(batch.req_ids), batch.num_tokens
    starts = batch.query_start_loc_cpu[: n + 1].tolist()
    seq_lens = batch.seq_lens_cpu[:n].tolist()
    schedule = []
    for i, req_id in enumerate(batch.req_ids):
        query_len = starts[i + 1] - starts[i]
        schedule.append((req_id, states.row_of[req_id], seq_lens[i] - query_len, query_len))
        extents[req_id] = seq_lens[i]
    ids = batch.input_ids[:num_tokens].tolist()
    positions = batch.positions[:num_tokens].tolist()
    slots = [s[:num_tokens].tolist() for s in batch.slot_mappings]
    gathered = []
    for i, (req_id, row, _, query_len) in enumerate(schedule):
        for t in range(starts[i], starts[i] + query_len):
            gathered.append(GatheredToken(req_id, row, positions[t], ids[t], tuple(s[t] for s in slots)))
    contents = {row: states.token_ids[row, : extents.get(r, 0)].tolist() for row, r in holders.items()}
    for r in [r for r in extents if r not in states.row_of]:  # rows given back: forget their extent
        del extents[r]
    return RowsStep(
        event.step, holders, given_back, handed_out, contents, schedule, gathered, list(event.finished_req_ids)
    )


class RequestRowsView(ipywidgets.VBox):
    """Which request holds which row of the runner's request state, and what each step gathered.

    The figure: one line per row (the padding row last), one cell per position; a cell holds the
    token id the row has there, in its request's colour; the cells this step gathered are drawn
    solid with a thick outline. Under it, what the host sent (rows, num_computed, query lengths)
    and each gathered token's row, position, id and slot. Attached to `llm` from construction
    until `detach()`; while the slider sits on the newest step it follows the run.
    """

    def __init__(
        self,
        llm: LLM,
        *,
        max_positions: int = 24,
        max_rows: int = 12,
        min_frame_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        self.max_positions = check_int("max_positions", max_positions, 1, hint=" (positions drawn per row)")
        self.max_rows = check_int("max_rows", max_rows, 1, hint=" (request rows drawn)")
        states = llm.runner.states
        self.padding_row = states.padding_row
        self.block_sizes = list(llm.runner.block_sizes)
        self.steps: list[RowsStep] = []
        self._holders = {row: r for r, row in states.row_of.items()}
        self._extents: dict[str, int] = {}
        self.play = ipywidgets.Play(min=0, max=0, value=0, interval=800, description="play")
        self.slider = ipywidgets.IntSlider(min=0, max=0, value=0, readout=False, description="step")
        ipywidgets.jslink((self.play, "value"), (self.slider, "value"))
        self.label = ipywidgets.HTML()
        self.figure = ipywidgets.HTML()
        self.table = ipywidgets.HTML()
        for part in (self.figure, self.table):
            part.add_class("pkv-view")
        controls = ipywidgets.HBox([self.play, self.slider, self.label])
        super().__init__([controls, self.figure, self.table], **kwargs)
        self.slider.observe(lambda change: self._show(change["new"]), "value")
        self._live = LiveRedraw(self._follow, min_frame_s=MIN_FRAME_S if min_frame_s is None else min_frame_s)
        self._detach: Callable[[], None] = llm.add_step_listener(self._on_step)
        self._show(0)

    @property
    def index(self) -> int:
        """The index of the step on display in `steps`."""
        return self.slider.value

    @index.setter
    def index(self, value: int) -> None:
        self.slider.value = slider_position(value, len(self.steps))

    def detach(self) -> None:
        """Stop recording steps (the recorded ones stay)."""
        self._detach()

    def close(self) -> None:
        self.detach()
        super().close()

    def _on_step(self, event: StepEvent) -> None:
        record = rows_step(event, self._holders, self._extents)
        self._holders = record.holders
        following = self.slider.value == self.slider.max
        self.steps.append(record)
        self.slider.max = self.play.max = len(self.steps) - 1
        if following:
            self._live.new_step()
        else:
            self.label.value = self._label(self.slider.value)

    def _follow(self) -> None:
        if self.slider.value != self.slider.max:
            self.slider.value = self.slider.max  # its observer draws
        else:
            self._show(self.slider.value)

    def _show(self, index: int) -> None:
        if not self.steps:
            self.figure.value = (
                f'<div style="{BASE_STYLE}; color:{FG_MUTED}">RequestRowsView: waiting for a step.</div>'
            )
            self.label.value = "<code>no steps yet</code>"
            return
        record = self.steps[index]
        figure, table = self.figure_html(record), self.table_html(record)
        self.figure.value, self.table.value, self.label.value = figure, table, self._label(index)

    def _label(self, index: int) -> str:
        if not self.steps:
            return "<code>no steps yet</code>"
        return f"<code>step {self.steps[index].step}</code> ({index + 1} of {len(self.steps)})"

    def shown_rows(self, record: RowsStep) -> list[int]:
        """The rows drawn: every row up to the highest one held (free ones between), then the padding row."""
        top = max([*record.holders, *record.given_back, 0])
        return [*range(min(top + 1, self.max_rows)), self.padding_row]

    def figure_html(self, record: RowsStep) -> str:
        """The rows as a themed matplotlib figure (a light and a dark PNG)."""
        rows = self.shown_rows(record)
        gathered = {(g.row, g.position) for g in record.gathered}
        end = max([len(c) for c in record.contents.values()] + [1])
        first = max(0, end - self.max_positions)
        # At least 16 columns: a row is wider than what it holds so far (max_model_len positions).
        width = max(min(end, self.max_positions), min(16, self.max_positions))
        fig, ax = plt.subplots(figsize=(2.2 + 0.36 * width, 0.8 + 0.34 * len(rows)), layout="constrained")
        for y, row in enumerate(rows):
            req_id = record.holders.get(row)
            color = request_color(req_id) if req_id is not None else None
            for p, token in enumerate(record.contents.get(row, [])):
                if p < first:
                    continue
                x, hit = p - first, (row, p) in gathered
                ax.add_patch(
                    Rectangle(
                        (x + 0.04, y + 0.06),
                        0.92,
                        0.88,
                        facecolor=color,
                        alpha=0.85 if hit else 0.25,
                        edgecolor="black" if hit else color,
                        linewidth=2.2 if hit else 0.6,
                    )
                )
                ax.text(x + 0.5, y + 0.5, str(token), ha="center", va="center", fontsize=9)
        labels = [self._row_label(record, row) for row in rows]
        ax.set_yticks([y + 0.5 for y in range(len(rows))], labels, fontsize=9)
        for tick, row in zip(ax.get_yticklabels(), rows):
            if row in record.holders:
                tick.set_fontweight("bold")
        ticks = list(range(0, width, max(1, width // 12)))
        ax.set_xticks([t + 0.5 for t in ticks], [str(first + t) for t in ticks], fontsize=9)
        ax.set_xlim(0, width)
        ax.set_ylim(len(rows), 0)
        ax.set_xlabel("position in the row (token_ids[row, position])", fontsize=9)
        ax.tick_params(length=0)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.set_title(f"step {record.step}: the request rows; outlined = gathered this step", fontsize=10)
        html = themed_figure_html(fig, alt=f"request rows at step {record.step}")
        plt.close(fig)  # else the inline backend draws it once more when the cell ends
        return html

    def _row_label(self, record: RowsStep, row: int) -> str:
        if row == self.padding_row:
            return f"row {row}: padding"
        if row in record.holders:
            new = ", new" if row in record.handed_out else ""
            return f"row {row}: req {record.holders[row]}{new}"
        return f"row {row}: free"

    def table_html(self, record: RowsStep) -> str:
        """What the host sent and what the device gathered, as HTML text."""
        lines = [f"<b>step {record.step}</b>"]
        if record.given_back:
            back = ", ".join(f"row {row} (req {esc(r)})" for row, r in sorted(record.given_back.items()))
            lines.append(f"given back before the step: {back}")
        if record.handed_out:
            out = ", ".join(f"req {esc(r)} &rarr; row {row}" for row, r in sorted(record.handed_out.items()))
            lines.append(f"handed out in the step: {out}")
        if record.finished:
            lines.append(f"finished in the step (rows given back at the next): {esc(', '.join(record.finished))}")
        hidden = sorted(row for row in record.holders if row >= self.max_rows)
        if hidden:
            lines.append(f"rows {hidden} are held but not drawn (max_rows={self.max_rows})")
        sent = (
            f"rows {record.rows_sent}, num_computed {[s[2] for s in record.schedule]}, "
            f"query_lens {[s[3] for s in record.schedule]}"
        )
        lines.append(f"the host sent (StepSchedule): {sent}")
        cell = f"padding:1px 6px; border:1px solid {BORDER}; text-align:right"
        groups = len(self.block_sizes)
        slot_heads = [f"slot g{g} (B={b})" if groups > 1 else f"slot (B={b})" for g, b in enumerate(self.block_sizes)]
        heads = ["token", "request", "row", "position", "input id", *slot_heads]
        head = "".join(f'<th style="{cell}; background:{BG_HEADER}">{esc(h)}</th>' for h in heads)
        body = []
        for t, g in enumerate(record.gathered):
            swatch = f'<span style="display:inline-block; width:9px; height:9px; background:{request_color(g.req_id)}"></span>'
            values = [t, f"{swatch} {esc(g.req_id)}", g.row, g.position, g.token_id, *g.slots]
            body.append("<tr>" + "".join(f'<td style="{cell}">{v}</td>' for v in values) + "</tr>")
        table = f'<table style="border-collapse:collapse; margin-top:4px"><tr>{head}</tr>{"".join(body)}</table>'
        legend = (
            f'<div style="color:{FG_MUTED}; margin-top:4px">gathered on the device: input id = '
            "token_ids[row, position]; slot = block_tables[g][row, position // B] * B + position % B.</div>"
        )
        return f'<div style="{BASE_STYLE}">{"<br>".join(lines)}{table}{legend}</div>{FIT_CSS}'

    def __repr__(self) -> str:
        if not self.steps:
            return "RequestRowsView(no steps yet)"
        record = self.steps[self.index]
        held = ", ".join(f"row {row}: req {r}" for row, r in sorted(record.holders.items())) or "none held"
        return f"RequestRowsView(step {record.step}, {len(self.steps)} recorded; {held})"
