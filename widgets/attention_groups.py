"""`AttentionGroupsView`: layers -> KV cache groups -> attention groups -> one metadata object."""

from __future__ import annotations

from pagedkv.trace import StepRecord
from pagedkv.widgets.common import BASE_STYLE, BG, BORDER, FG_MUTED, PALETTE, SVG_STYLE, TraceView, esc, short_layer

ROW_H = 26
GROUP_MIN_H = 56
"""An attention group is drawn at least this tall, so its three lines of text fit."""
COLUMNS = {"layer": (0, 110), "kv": (140, 240), "attn": (410, 260), "meta": (700, 250)}
WIDTH = 952


def _tint(color: str) -> str:
    """A light wash of `color` over the theme's background: text in the theme's colour stays readable."""
    return f"fill:{color}; fill-opacity:0.16"


# Box fills per column: the theme background for layers, washes of three request-palette hues.
LAYER_FILL, KV_FILL, ATTN_FILL, META_FILL = f"fill:{BG}", _tint(PALETTE[0]), _tint(PALETTE[5]), _tint(PALETTE[2])


def _box(column: str, y: float, h: float, lines: list[str], cls: str, fill: str, data: str = "") -> str:
    """A rounded box in `column` from `y` to `y + h` (pixels), one text line per entry; `fill` is a CSS style."""
    x, w = COLUMNS[column]
    first = y + h / 2 - (len(lines) - 1) * 7 + 4
    text = "".join(
        f'<text x="{x + 6}" y="{first + i * 14:.0f}" font-size="11" font-weight="{"bold" if i == 0 else "normal"}">'
        f"{esc(line)}</text>"
        for i, line in enumerate(lines)
    )
    return (
        f'<g class="{cls}"{data}><rect x="{x}" y="{y + 2:.0f}" width="{w}" height="{h - 4:.0f}" rx="5" '
        f'style="{fill}; stroke:{BORDER}"/>{text}</g>'
    )


def _link(left: str, right: str, y: float) -> str:
    """A horizontal arrow from the right edge of one column to the left edge of the next, at height `y`."""
    x1, x2 = sum(COLUMNS[left]), COLUMNS[right][0]
    return (
        f'<line x1="{x1}" y1="{y:.0f}" x2="{x2}" y2="{y:.0f}" style="stroke:{FG_MUTED}" marker-end="url(#pkv-arrow)"/>'
    )


class AttentionGroupsView(TraceView):
    """How layers share work each step.

    Layers with equal KV cache specs form a KV cache group (one block table, one slot
    mapping). Inside a group, layers with the same backend form an attention group, which
    owns one metadata builder. Each step, each builder runs `build()` once, and every layer
    of its group receives that very object: the right column shows which object each layer
    got in the step on display, so "shared" is something you can see, not take on faith.
    """

    needs_step = False

    def render(self, record: StepRecord | None) -> str:
        engine = self.engine
        parts: list[str] = []
        y = 0.0
        for kv_group in engine.kv_cache_groups:
            spec = kv_group.spec
            kv_top = y
            for attn in (a for a in engine.attention_groups if a.kv_cache_group_id == kv_group.group_id):
                n = len(attn.layer_names)
                h = max(n * ROW_H, GROUP_MIN_H)
                for i, name in enumerate(attn.layer_names):
                    parts.append(
                        _box(
                            "layer",
                            y + i * h / n,
                            h / n,
                            [short_layer(name)],
                            "pkv-layer",
                            LAYER_FILL,
                            f' data-layer="{esc(name)}"',
                        )
                    )
                    parts.append(_link("layer", "kv", y + (i + 0.5) * h / n))
                center = y + h / 2
                parts.append(_link("kv", "attn", center))
                parts.append(
                    _box(
                        "attn",
                        y,
                        h,
                        [
                            f"attention group: {attn.backend}",
                            attn.builder,
                            f"{attn.num_heads} query heads, {n} layer(s)",
                        ],
                        "pkv-attn-group",
                        ATTN_FILL,
                    )
                )
                if record is not None:
                    # One box per distinct object the group's layers received: one, unless build() misbehaves.
                    for k in sorted({record.metadata_index(name) for name in attn.layer_names}):
                        meta = record.metadata[k]
                        parts.append(_link("attn", "meta", center))
                        parts.append(
                            _box(
                                "meta",
                                y,
                                h,
                                [
                                    f"#{k} {meta.type_name}",
                                    f"metadata built once in step {record.step}",
                                    f"the same object in {len(meta.layer_names)} layer(s)",
                                ],
                                "pkv-metadata",
                                META_FILL,
                                f' data-metadata-index="{k}"',
                            )
                        )
                y += h
            window = f", window {spec.sliding_window}" if spec.sliding_window else ""
            parts.insert(
                0,
                _box(
                    "kv",
                    kv_top,
                    y - kv_top,
                    [
                        f"KV cache group {kv_group.group_id}",
                        f"{spec.kind}{window}",
                        f"{spec.block_size} tok/block, {spec.num_kv_heads} kv heads x {spec.head_size}",
                    ],
                    "pkv-kv-group",
                    KV_FILL,
                    f' data-group="{kv_group.group_id}"',
                ),
            )
        caption = (
            "no step yet: run the engine to see the metadata objects"
            if record is None
            else f"step {record.step}: {len(record.metadata)} metadata object(s) built for "
            f"{len(record.attn_metadata_keys)} layers"
        )
        return (
            f'<div class="pkv-attention-groups" style="{BASE_STYLE}"><div>{esc(caption)}</div>'
            f'<svg width="100%" viewBox="0 0 {WIDTH} {y:.0f}" style="max-width:{WIDTH}px; {SVG_STYLE}" '
            f'xmlns="http://www.w3.org/2000/svg" font-family="ui-monospace, Menlo, Consolas, monospace">'
            '<defs><marker id="pkv-arrow" viewBox="0 0 6 6" refX="6" refY="3" markerWidth="6" '
            f'markerHeight="6" orient="auto"><path d="M0,0 L6,3 L0,6 z" style="fill:{FG_MUTED}"/></marker></defs>'
            f"{''.join(parts)}</svg></div>"
        )
