"""`BlockTableView`: the physical KV cache blocks, who owns them, and each request's block table."""

from __future__ import annotations

from typing import Any

from pagedkv.checks import check_int, check_optional_bool
from pagedkv.trace import BlockPoolRecord, KVCacheGroupInfo, StepRecord, StepTrace
from pagedkv.widgets.common import (
    ACCENT,
    BASE_STYLE,
    BG,
    BG_SOLID,
    BORDER,
    FG,
    FG_MUTED,
    SVG_STYLE,
    TraceView,
    esc,
    request_color,
    short_layer,
)

CELL_W, CELL_H, GAP = 56, 40, 4
HIT_BORDER = f"3px double {FG}"
"""A row's block found in the prefix cache: a double outline in the text colour, which no request
colour is (PALETTE), and which reads in both themes."""
QUEUE_SHOWN = 12
"""Entries of the free queue written out under a grid; the rest are counted."""


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

    With prefix caching one block can sit in several block tables: its cell carries a bar with
    one segment per owner, in the owners' colours, and its ref count (x2). A free block that
    still holds a cached prefix is evictable, drawn outlined and hatched with its short hash and
    its place in the free queue; "next" marks the block the next allocation takes; in a row, a
    block found in the cache has a double outline in the text colour (no request's colour).
    These details (and their legend) show when the engine caches prefixes, or when
    `show_caching=True`; `show_caching=False` hides them.
    """

    def __init__(
        self,
        trace: StepTrace,
        *,
        max_blocks: int = 256,
        columns: int = 16,
        show_caching: bool | None = None,
        **kwargs: Any,
    ) -> None:
        self.max_blocks = check_int("max_blocks", max_blocks, 1, hint=" (blocks drawn per KV cache group)")
        self.columns = check_int("columns", columns, 1, hint=" (blocks per row of the grid)")
        self.show_caching = check_optional_bool("show_caching", show_caching, hint=" (None: when the engine caches)")
        super().__init__(trace, **kwargs)

    @property
    def caching_shown(self) -> bool:
        """Whether prefix-caching details are drawn: `show_caching`, or else the engine's setting."""
        return self.engine.prefix_caching if self.show_caching is None else self.show_caching

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
        if self.caching_shown and record.block_pools:
            pool = record.block_pools[0]  # caching runs with one KV cache group: full attention only
            lines.append(
                f"prefix cache: {record.num_cached_tokens} tokens found in it by requests admitted in this step; "
                f"after the step {pool.num_cached_blocks} blocks hold a cached prefix, "
                f"{len(pool.evictable())} of them free (evictable)"
            )
        grids = "".join(self._grid(record, group) for group in engine.kv_cache_groups)
        return (
            f'<div class="pkv-block-table" data-step="{record.step}" style="{BASE_STYLE}">'
            f"<div>{'<br>'.join(lines)}</div>{grids}{self._rows(record)}{_LEGEND}"
            f"{_CACHING_LEGEND if self.caching_shown else ''}</div>"
        )

    def _grid(self, record: StepRecord, group: KVCacheGroupInfo) -> str:
        g, bs = group.group_id, group.spec.block_size
        owners, filled = _block_usage(record, g, bs)
        written = {s for s in record.slot_mappings[g] if s >= 0}
        shown = min(self.engine.num_blocks, self.max_blocks)
        rows = -(-shown // self.columns)
        width, height = self.columns * (CELL_W + GAP), rows * (CELL_H + GAP)
        pool = record.block_pools[g] if record.block_pools else None  # traces older than block_pools: none
        queue = pool.free_queue_order() if pool is not None else []
        place = {block: i + 1 for i, block in enumerate(queue)}
        hashes = pool if self.caching_shown else None  # the pool's hashes are drawn only with caching shown
        cells = [
            self._cell(b, bs, owners.get(b, []), filled.get(b, 0), written, g, hashes, place.get(b))
            for b in range(shown)
        ]
        spec = group.spec
        window = f" (window {spec.sliding_window})" if spec.sliding_window else ""
        title = (
            f"KV cache group {g}: {spec.kind}{window}, {bs} tokens per block, "
            f"layers {', '.join(short_layer(n) for n in group.layer_names)}"
        )
        hidden = self.engine.num_blocks - shown
        note = f"<div>blocks {shown}..{self.engine.num_blocks - 1} not drawn ({hidden} more)</div>" if hidden else ""
        if self.caching_shown:
            note += _queue_line(pool, queue)
        return (
            f'<div style="margin-top:8px">{esc(title)}</div>'
            f'<svg class="pkv-grid" data-group="{g}" data-num-blocks="{shown}" width="100%" '
            f'viewBox="0 0 {width} {height}" style="max-width:{width}px; {SVG_STYLE}" xmlns="http://www.w3.org/2000/svg">'
            f"{''.join(cells)}</svg>{note}"
        )

    def _cell(
        self,
        block: int,
        bs: int,
        owners: list[str],
        filled: int,
        written: set[int],
        group: int,
        pool: BlockPoolRecord | None,
        place: int | None,
    ) -> str:
        """One block: null, free (plain or cached), or held by one request or several."""
        x = (block % self.columns) * (CELL_W + GAP)
        y = (block // self.columns) * (CELL_H + GAP)
        attrs = f'class="pkv-block" data-block-id="{block}" data-group="{group}"'
        short_hash = pool.block_hashes[block] if pool is not None else None
        if block == 0:
            return (
                f'<g {attrs} data-state="null"><title>block 0: the null block, never handed out</title>'
                f'<rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" rx="3" style="fill:{BG_SOLID}"/>'
                f'<text x="{x + 4}" y="{y + 13}" font-size="10">0 null</text></g>'
            )
        if not owners:
            return self._free_cell(block, x, y, attrs, short_hash, place)
        color = request_color(owners[0])
        shared = len(owners) > 1
        label = f"x{len(owners)}" if shared else f"r{owners[0]}"
        tick_w = (CELL_W - 6) / bs
        ticks = []
        for offset in range(bs):
            slot = block * bs + offset
            # A shared block's K/V belong to all its owners: no one owner's colour.
            fill = (FG_MUTED if shared else color) if offset < filled else BG
            opacity = "1" if slot in written else ("0.5" if offset < filled else "1")
            # Outlined in the text colour: it contrasts with the background in either theme.
            stroke, cls = (f"; stroke:{FG}; stroke-width:1.5", ' class="pkv-written"') if slot in written else ("", "")
            ticks.append(
                f'<rect{cls} x="{x + 3 + offset * tick_w:.1f}" y="{y + 24}" width="{tick_w:.1f}" height="12" '
                f'style="fill:{fill}; fill-opacity:{opacity}{stroke}"/>'
            )
        holders = f"{'shared by' if shared else 'held by'} request(s) {', '.join(owners)}"
        tip = f"block {block}: {holders}; {filled}/{bs} slots filled"
        if short_hash is not None:
            tip += f"; cached, hash {short_hash}"
        if place is not None:  # every owner finished in this step
            tip += f"; free after this step, #{place} in the free queue"
        if shared:
            # Every owner's colour, side by side: the cell's fill and border can show only one.
            seg_w = (CELL_W - 6) / len(owners)
            owner_bar = "".join(
                f'<rect class="pkv-owner" data-owner="{esc(o)}" x="{x + 3 + i * seg_w:.1f}" y="{y + 17}" '
                f'width="{seg_w:.1f}" height="5" fill="{request_color(o)}"/>'
                for i, o in enumerate(owners)
            )
            frame = f'style="fill:{BG}; stroke:{FG}" stroke-width="2"'  # theme variables: CSS, not attributes
        else:
            owner_bar, frame = "", f'fill="{color}" fill-opacity="0.18" stroke="{color}" stroke-width="1.5"'
        return (
            f'<g {attrs} data-state="{"shared" if shared else "used"}" data-owner="{esc(",".join(owners))}"'
            f"{_hash_attr(short_hash)}><title>{esc(tip)}</title>"
            f'<rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" rx="3" {frame}/>{owner_bar}'
            f'<text x="{x + 4}" y="{y + 13}" font-size="10">{block}</text>'
            f'<text x="{x + CELL_W - 4}" y="{y + 13}" font-size="10" text-anchor="end">'
            f"{esc(label)}</text>"
            f"{''.join(ticks)}</g>"
        )

    def _free_cell(self, block: int, x: int, y: int, attrs: str, short_hash: str | None, place: int | None) -> str:
        """A free block: dashed when empty, outlined and hatched with its hash when it holds a cached
        prefix (evictable); the head of the free queue says "next"."""
        is_next = place == 1
        mark = (
            f'<text x="{x + CELL_W - 4}" y="{y + 13}" font-size="10" text-anchor="end">'
            f"{'next' if is_next else f'#{place}'}</text>"
            if place is not None and (is_next or short_hash is not None)
            else ""
        )
        stroke = f"stroke:{ACCENT}; stroke-width:2.5" if is_next else f"stroke:{FG_MUTED if short_hash else BORDER}"
        where = f", #{place} in the free queue" if place is not None else ""
        attrs += ' data-next="true"' if is_next else ""
        if short_hash is None:
            dashes = "" if is_next else ' stroke-dasharray="3 2"'
            return (
                f'<g {attrs} data-state="free"><title>block {block}: free{where}</title>'
                f'<rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" rx="3" style="fill:{BG}; {stroke}"{dashes}/>'
                f'<text x="{x + 4}" y="{y + 13}" style="fill:{FG_MUTED}" font-size="10">{block}</text>{mark}</g>'
            )
        # Hatching: short slashes under the hash (lines, not a <pattern>: a pattern's id would be
        # shared by every view on the page).
        hatch = "".join(
            f'<line x1="{x + 4 + 8 * i}" y1="{y + CELL_H - 3}" x2="{x + 10 + 8 * i}" y2="{y + CELL_H - 11}" '
            f'style="stroke:{FG_MUTED}" stroke-width="1"/>'
            for i in range((CELL_W - 10) // 8)
        )
        tip = (
            f"block {block}: free but cached (hash {short_hash}){where}: a request with this prefix takes it "
            "back; an allocation that reaches it evicts it"
        )
        return (
            f'<g {attrs} data-state="cached"{_hash_attr(short_hash)}>'
            f"<title>{esc(tip)}</title>"
            f'<rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" rx="3" style="fill:{BG}; {stroke}"/>'
            f'<text x="{x + 4}" y="{y + 13}" font-size="10">{block}</text>{mark}'
            f'<text x="{x + 4}" y="{y + 25}" style="fill:{FG_MUTED}" font-size="9">{esc(short_hash)}</text>{hatch}</g>'
        )

    def _rows(self, record: StepRecord) -> str:
        """Each request's block table row per KV cache group: logical index over physical id."""
        out = ['<table style="margin-top:8px; border-collapse:collapse">']
        bs = self.engine.block_size
        for r in record.requests:
            color = request_color(r.req_id)
            what = f"{r.phase}, {r.num_computed_tokens} in the KV cache + {r.num_new_tokens} new"
            hits = 0
            if r.num_cached_tokens and self.caching_shown:
                what += f" ({r.num_cached_tokens} found by prefix caching)"
                hits = r.num_cached_tokens // bs  # its leading blocks taken from the cache in this step
            groups = []
            for g, row in enumerate(r.block_ids):
                boxes = "".join(
                    f'<span class="pkv-row-cell{" pkv-hit" if j < hits else ""}" '
                    f'title="logical block {j} -> physical block {b}{" (a prefix cache hit)" if j < hits else ""}" '
                    f'style="display:inline-block; min-width:22px; margin:1px; text-align:center; '
                    f"border:{HIT_BORDER if j < hits else f'1px solid {color if b else BORDER}'}; "
                    f'background:{BG if b else BG_SOLID}">'
                    f'<span style="font-size:9px; color:{FG_MUTED if b else FG}">{j}</span><br>{b}</span>'
                    for j, b in enumerate(row)
                )
                prefix = f"g{g} " if len(r.block_ids) > 1 else ""
                groups.append(f"{prefix}{boxes}")
            out.append(
                f'<tr><td style="padding-right:8px; white-space:nowrap"><span style="display:inline-block; width:9px; height:9px; background:{color}"></span> '
                f"req {esc(r.req_id)}<br><span style='color:{FG_MUTED}'>{esc(what)}</span></td>"
                f"<td>{'<br>'.join(groups)}</td></tr>"
            )
        out.append("</table>")
        return "".join(out)


def _hash_attr(short_hash: str | None) -> str:
    return f' data-hash="{esc(short_hash)}"' if short_hash is not None else ""


def _queue_line(pool: BlockPoolRecord | None, queue: list[int]) -> str:
    """The free queue after the step, head first: cached blocks with their hash, runs of
    consecutive uncached ones joined ("14-23": never used, or partly filled when freed)."""
    if pool is None:
        return ""
    parts: list[tuple[list[int], str | None]] = []  # (block ids, hash of the one cached block or None)
    for block in queue:
        short_hash = pool.block_hashes[block]
        if short_hash is None and parts and parts[-1][1] is None and parts[-1][0][-1] + 1 == block:
            parts[-1][0].append(block)
        else:
            parts.append(([block], short_hash))
    texts = [
        f"<b>{ids[0]}</b> <span style='color:{FG_MUTED}'>({esc(h)})</span>"
        if h is not None
        else (f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0]))
        for ids, h in parts
    ]
    more = f" &rarr; &hellip; {len(texts) - QUEUE_SHOWN} more" if len(texts) > QUEUE_SHOWN else ""
    return (
        f'<div class="pkv-free-queue">free queue after the step, the next block handed out first; '
        f"bold = still cached (its hash): {' &rarr; '.join(texts[:QUEUE_SHOWN]) or 'empty'}{more}</div>"
    )


_LEGEND = (
    f'<div style="color:{FG_MUTED}; margin-top:4px">cell = physical block (id top left, owner top right, '
    "border in the owner's colour); ticks = its slots: filled = K/V cached, outlined = written by this step; "
    "dashed = free; solid grey = null block 0. Rows: small number = logical block, big = physical block.</div>"
)
_CACHING_LEGEND = (
    f'<div style="color:{FG_MUTED}">prefix caching: a bar of owner colours and xN = a block in N block tables '
    "(N requests share its prefix); outlined and hatched, with a hash = free but cached, evictable (#k = its "
    "place in the free queue); accent outline and next = the block the next allocation takes; double outline "
    "in a row = a block found in the prefix cache when the request was admitted in this step.</div>"
)
