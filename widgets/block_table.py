"""`BlockTableView`: the physical KV cache blocks, who owns them, and each request's block table."""

from __future__ import annotations

from typing import Any

from pagedkv.trace import KVCacheGroupInfo, StepRecord, StepTrace
from pagedkv.widgets.common import (
    BASE_STYLE, BG, BG_SOLID, BORDER, FG, FG_MUTED, SVG_STYLE, TraceView, esc, request_color, short_layer,
)

CELL_W, CELL_H, GAP = 56, 40, 4


def _block_usage(record: StepRecord, group: int, block_size: int) -> tuple[dict[int, list[str]], dict[int, int]]:
    """Per physical block: the requests holding it, and how many of its slots hold K/V after the step."""
    owners: dict[int, list[str]] = {}
    filled: dict[int, int] = {}
    for r in record.requests:
        seq_len = r.num_computed_tokens + r.num_new_tokens
        for j, block in enumerate(r.block_ids[group]):
            if block == 0:  # the null block stands in for a block given back (sliding window)
                continue
            owners.setdefault(block, []).append(r.req_id)
            filled[block] = max(filled.get(block, 0), min(block_size, max(seq_len - j * block_size, 0)))
    return owners, filled


class BlockTableView(TraceView):
    """The block pool as a grid: one cell per physical block, coloured by the request that owns it.

    Inside each cell, one tick per slot: filled ticks hold K/V, ticks outlined in the text
    colour were written by this step (its slot mapping). Free blocks are dashed, block 0 (solid
    grey) is the null block. Below the grid, each request's block table row: logical block j -> physical id.
    Only the last block of a request can have empty slots: that is all the waste paging leaves.
    """

    def __init__(self, trace: StepTrace, *, max_blocks: int = 256, columns: int = 16, **kwargs: Any) -> None:
        self.max_blocks = max_blocks
        self.columns = columns
        super().__init__(trace, **kwargs)

    def render(self, record: StepRecord) -> str:
        engine = self.engine
        usable = engine.num_blocks - 1
        lines = [
            f"<b>step {record.step}</b> &middot; group {g}: {record.num_blocks_in_use[g]} of {usable} usable "
            f"blocks in use during the step, {record.num_free_blocks[g]} free after it"
            for g in range(engine.num_kv_cache_groups)
        ]
        if record.preempted_req_ids:
            lines.append(f"preempted before this step (blocks freed): {esc(', '.join(record.preempted_req_ids))}")
        if record.finished_req_ids:
            lines.append(f"finished in this step (blocks freed after it): {esc(', '.join(record.finished_req_ids))}")
        grids = "".join(self._grid(record, group) for group in engine.kv_cache_groups)
        return (
            f'<div class="pkv-block-table" data-step="{record.step}" style="{BASE_STYLE}">'
            f'<div>{"<br>".join(lines)}</div>{grids}{self._rows(record)}{_LEGEND}</div>'
        )

    def _grid(self, record: StepRecord, group: KVCacheGroupInfo) -> str:
        g, bs = group.group_id, group.spec.block_size
        owners, filled = _block_usage(record, g, bs)
        written = {s for s in record.slot_mappings[g] if s >= 0}
        shown = min(self.engine.num_blocks, self.max_blocks)
        rows = -(-shown // self.columns)
        width, height = self.columns * (CELL_W + GAP), rows * (CELL_H + GAP)
        cells = [self._cell(b, bs, owners.get(b, []), filled.get(b, 0), written, g) for b in range(shown)]
        spec = group.spec
        window = f" (window {spec.sliding_window})" if spec.sliding_window else ""
        title = (
            f"KV cache group {g}: {spec.kind}{window}, {bs} tokens per block, "
            f"layers {', '.join(short_layer(n) for n in group.layer_names)}"
        )
        hidden = self.engine.num_blocks - shown
        note = f"<div>blocks {shown}..{self.engine.num_blocks - 1} not drawn ({hidden} more)</div>" if hidden else ""
        return (
            f'<div style="margin-top:8px">{esc(title)}</div>'
            f'<svg class="pkv-grid" data-group="{g}" data-num-blocks="{shown}" width="100%" '
            f'viewBox="0 0 {width} {height}" style="max-width:{width}px; {SVG_STYLE}" xmlns="http://www.w3.org/2000/svg">'
            f'{"".join(cells)}</svg>{note}'
        )

    def _cell(self, block: int, bs: int, owners: list[str], filled: int, written: set[int], group: int) -> str:
        x = (block % self.columns) * (CELL_W + GAP)
        y = (block // self.columns) * (CELL_H + GAP)
        attrs = f'class="pkv-block" data-block-id="{block}" data-group="{group}"'
        if block == 0:
            return (
                f'<g {attrs} data-state="null"><title>block 0: the null block, never handed out</title>'
                f'<rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" rx="3" style="fill:{BG_SOLID}"/>'
                f'<text x="{x + 4}" y="{y + 13}" font-size="10">0 null</text></g>'
            )
        if not owners:
            return (
                f'<g {attrs} data-state="free"><title>block {block}: free</title>'
                f'<rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" rx="3" '
                f'style="fill:{BG}; stroke:{BORDER}" stroke-dasharray="3 2"/>'
                f'<text x="{x + 4}" y="{y + 13}" style="fill:{FG_MUTED}" font-size="10">{block}</text></g>'
            )
        color = request_color(owners[0])
        shared = len(owners) > 1
        label = f"x{len(owners)}" if shared else f"r{owners[0]}"
        tick_w = (CELL_W - 6) / bs
        ticks = []
        for offset in range(bs):
            slot = block * bs + offset
            fill = color if offset < filled else BG
            opacity = "1" if slot in written else ("0.5" if offset < filled else "1")
            # Outlined in the text colour: it contrasts with the background in either theme.
            stroke, cls = (f"; stroke:{FG}; stroke-width:1.5", ' class="pkv-written"') if slot in written else ("", "")
            ticks.append(
                f'<rect{cls} x="{x + 3 + offset * tick_w:.1f}" y="{y + 24}" width="{tick_w:.1f}" height="12" '
                f'style="fill:{fill}; fill-opacity:{opacity}{stroke}"/>'
            )
        holders = f"{'shared by' if shared else 'held by'} request(s) {', '.join(owners)}"
        tip = f"block {block}: {holders}; {filled}/{bs} slots filled"
        return (
            f'<g {attrs} data-state="{"shared" if shared else "used"}" data-owner="{esc(",".join(owners))}">'
            f"<title>{esc(tip)}</title>"
            f'<rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" rx="3" fill="{color}" fill-opacity="0.18" '
            f'stroke="{color}" stroke-width="{3 if shared else 1.5}"/>'
            f'<text x="{x + 4}" y="{y + 13}" font-size="10">{block}</text>'
            f'<text x="{x + CELL_W - 4}" y="{y + 13}" font-size="10" text-anchor="end">'
            f"{esc(label)}</text>"
            f'{"".join(ticks)}</g>'
        )

    def _rows(self, record: StepRecord) -> str:
        """Each request's block table row per KV cache group: logical index over physical id."""
        out = ['<table style="margin-top:8px; border-collapse:collapse">']
        for r in record.requests:
            color = request_color(r.req_id)
            what = f"{r.phase}, {r.num_computed_tokens} cached + {r.num_new_tokens} new"
            groups = []
            for g, row in enumerate(r.block_ids):
                boxes = "".join(
                    f'<span class="pkv-row-cell" title="logical block {j} -> physical block {b}" '
                    f'style="display:inline-block; min-width:22px; margin:1px; text-align:center; '
                    f'border:1px solid {color if b else BORDER}; background:{BG if b else BG_SOLID}">'
                    f'<span style="font-size:9px; color:{FG_MUTED if b else FG}">{j}</span><br>{b}</span>'
                    for j, b in enumerate(row)
                )
                prefix = f"g{g} " if len(r.block_ids) > 1 else ""
                groups.append(f"{prefix}{boxes}")
            out.append(
                f'<tr><td style="padding-right:8px; white-space:nowrap"><span style="display:inline-block; width:9px; height:9px; background:{color}"></span> '
                f"req {esc(r.req_id)}<br><span style='color:{FG_MUTED}'>{esc(what)}</span></td>"
                f'<td>{"<br>".join(groups)}</td></tr>'
            )
        out.append("</table>")
        return "".join(out)


_LEGEND = (
    f'<div style="color:{FG_MUTED}; margin-top:4px">cell = physical block (id top left, owner top right, '
    "border in the owner's colour); ticks = its slots: filled = K/V cached, outlined = written by this step; "
    "dashed = free; solid grey = null block 0. Rows: small number = logical block, big = physical block.</div>"
)
