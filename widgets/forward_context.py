"""`ForwardContextView`: the prop table -- what each layer finds under its name during one step."""

from __future__ import annotations

from pagedkv.trace import StepRecord
from pagedkv.widgets.common import BASE_STYLE, BG_HEADER, BORDER_LIGHT, TraceView, esc

_CELL = f"padding:2px 6px; border:1px solid {BORDER_LIGHT}; text-align:left; vertical-align:top"


def _preview(values: list[int], limit: int = 8) -> str:
    head = ", ".join(str(v) for v in values[:limit])
    return f"[{head}{', ...' if len(values) > limit else ''}] ({len(values)})"


class ForwardContextView(TraceView):
    """One row per layer name: the entries `set_forward_context` put under that name.

    Like a theatre's prop table, every spot is labelled with an actor's name: during the
    forward pass each attention op looks up `attn_metadata[name]` and `slot_mapping[name]`
    and its KV cache (bound once at start-up). Rows that point at the same metadata number
    hold the *same object*: it was built once for their attention group.
    """

    def render(self, record: StepRecord) -> str:
        engine = self.engine
        descriptor = ", ".join(f"{k}={v}" for k, v in record.batch_descriptor.items())
        rows = []
        for name in engine.layer_names:
            group = engine.group_of(name).kv_cache_group_id
            if name in record.attn_metadata_keys:
                k = record.metadata_index(name)
                others = len(record.metadata[k].layer_names) - 1
                meta = f"#{k} {record.metadata[k].type_name}" + (f" (shared with {others} more)" if others else "")
            else:
                meta = "(none)"
            slots = _preview(record.slot_mappings[group]) if name in record.slot_mapping_keys else "(none)"
            rows.append(
                f'<tr class="pkv-fc-row" data-layer="{esc(name)}"><td style="{_CELL}">{esc(name)}</td>'
                f'<td style="{_CELL}">{esc(meta)}</td><td style="{_CELL}">g{group} {esc(slots)}</td>'
                f'<td style="{_CELL}">{esc(engine.kv_cache_shapes[name])}</td></tr>'
            )
        objects = "".join(
            f"<li>#{k} {esc(m.type_name)}: " + ", ".join(f"{esc(f)}={esc(v)}" for f, v in m.fields.items()) + "</li>"
            for k, m in enumerate(record.metadata)
        )
        header = "".join(
            f'<th style="{_CELL}; background:{BG_HEADER}">{h}</th>'
            for h in (
                "layer name (the key)",
                "attn_metadata[name]",
                "slot_mapping[name]",
                "kv_cache shape (bound once)",
            )
        )
        return (
            f'<div class="pkv-forward-context" data-step="{record.step}" style="{BASE_STYLE}">'
            f"<div><b>step {record.step}</b> &middot; cudagraph_runtime_mode={esc(record.cudagraph_mode)} "
            f"&middot; batch_descriptor=({esc(descriptor)})</div>"
            f'<table style="border-collapse:collapse; margin-top:4px"><tr>{header}</tr>{"".join(rows)}</table>'
            f'<div style="margin-top:4px">metadata objects of this step:</div><ul style="margin:0">{objects}</ul></div>'
        )
