"""`AttentionGroupsView`: layers -> KV cache groups -> attention groups -> one metadata object."""

from __future__ import annotations

from pagedkv.trace import StepRecord
from widgets.common import BASE_STYLE, TraceView, esc, short_layer

ROW_H = 28
COLUMNS = {"layer": (0, 130), "kv": (170, 230), "attn": (440, 250), "meta": (730, 210)}
WIDTH = 940


def _box(column: str, top: int, rows: int, lines: list[str], cls: str, color: str, data: str = "") -> str:
    """A rounded box spanning `rows` rows in `column`, with one text line per entry."""
    x, w = COLUMNS[column]
    y, h = top * ROW_H + 2, rows * ROW_H - 4
    first = y + h / 2 - (len(lines) - 1) * 7 + 4
    text = "".join(
        f'<text x="{x + 6}" y="{first + i * 14:.0f}" font-size="11" font-weight="{"bold" if i == 0 else "normal"}">'
        f"{esc(line)}</text>"
        for i, line in enumerate(lines)
    )
    return (
        f'<g class="{cls}"{data}><rect x="{x}" y="{y}" width="{w}" height="{h}" rx="5" '
        f'fill="{color}" stroke="#555"/>{text}</g>'
    )


def _link(left: str, right: str, row: float) -> str:
    """A horizontal connector between two columns at the middle of `row`."""
    x1 = sum(COLUMNS[left])
    x2 = COLUMNS[right][0]
    y = row * ROW_H + ROW_H / 2
    return f'<line x1="{x1}" y1="{y:.0f}" x2="{x2}" y2="{y:.0f}" stroke="#777" marker-end="url(#pkv-arrow)"/>'


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
        row = 0
        for kv_group in engine.kv_cache_groups:
            spec = kv_group.spec
            attn_groups = [a for a in engine.attention_groups if a.kv_cache_group_id == kv_group.group_id]
            kv_rows = sum(len(a.layer_names) for a in attn_groups)
            window = f", window {spec.sliding_window}" if spec.sliding_window else ""
            parts.append(_box("kv", row, kv_rows, [
                f"KV cache group {kv_group.group_id}",
                f"{spec.kind}{window}",
                f"{spec.block_size} tok/block, {spec.num_kv_heads} kv heads x {spec.head_size}",
            ], "pkv-kv-group", "#e8f0fb", f' data-group="{kv_group.group_id}"'))
            for attn in attn_groups:
                n = len(attn.layer_names)
                for i, name in enumerate(attn.layer_names):
                    parts.append(_box("layer", row + i, 1, [short_layer(name)], "pkv-layer", "#fff",
                                      f' data-layer="{esc(name)}"'))
                    parts.append(_link("layer", "kv", row + i))
                center = row + (n - 1) / 2
                parts.append(_link("kv", "attn", center))
                parts.append(_box("attn", row, n, [
                    f"attention group: {attn.backend}",
                    f"builder: {attn.builder}",
                    f"{attn.num_heads} query heads, {n} layer(s)",
                ], "pkv-attn-group", "#fdf1dc"))
                if record is not None:
                    indices = sorted({record.metadata_index(name) for name in attn.layer_names})
                    for k in indices:
                        meta = record.metadata[k]
                        parts.append(_link("attn", "meta", center))
                        parts.append(_box("meta", row, n, [
                            f"metadata #{k}: {meta.type_name}",
                            f"built once in step {record.step}",
                            f"same object in {len(meta.layer_names)} layer(s)",
                        ], "pkv-metadata", "#e3f4e6", f' data-metadata-index="{k}"'))
                row += n
        height = row * ROW_H
        caption = (
            "no step yet: run the engine to see the metadata objects" if record is None
            else f"step {record.step}: {len(record.metadata)} metadata object(s) built for "
                 f"{len(record.attn_metadata_keys)} layers"
        )
        return (
            f'<div class="pkv-attention-groups" style="{BASE_STYLE}"><div>{esc(caption)}</div>'
            f'<svg width="100%" viewBox="0 0 {WIDTH} {height}" style="max-width:{WIDTH}px" '
            f'xmlns="http://www.w3.org/2000/svg" font-family="ui-monospace, Menlo, Consolas, monospace">'
            '<defs><marker id="pkv-arrow" viewBox="0 0 6 6" refX="6" refY="3" markerWidth="6" '
            'markerHeight="6" orient="auto"><path d="M0,0 L6,3 L0,6 z" fill="#777"/></marker></defs>'
            f'{"".join(parts)}</svg></div>'
        )
