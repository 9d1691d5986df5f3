"""`SlotMappingView`: where each token of a step writes its K/V in the paged cache."""

from __future__ import annotations

from typing import Any

from pagedkv.trace import StepRecord, StepTrace
from widgets.common import BASE_STYLE, TraceView, esc, request_color

_CELL = "padding:1px 4px; border:1px solid #ddd; text-align:center"


class SlotMappingView(TraceView):
    """One column per token of the step: its request, position, block and slot.

        logical block = position // block_size          (which entry of the request's row)
        physical block = block_table[request][logical]  (which block of the pool)
        slot = physical block * block_size + position % block_size

    Padding tokens (added to reach a captured CUDA graph size) get slot -1 and write nothing.
    """

    def __init__(self, trace: StepTrace, *, max_tokens: int = 48, **kwargs: Any) -> None:
        self.max_tokens = max_tokens
        super().__init__(trace, **kwargs)

    def render(self, record: StepRecord) -> str:
        rows_by_req = {r.req_id: r.block_ids for r in record.scheduled}
        req_ids = record.token_req_ids()
        num_slots = max(len(s) for s in record.slot_mappings)
        shown = min(num_slots, self.max_tokens)

        def row(label: str, cells: list[str]) -> str:
            return f'<tr><th style="{_CELL}; text-align:right; white-space:nowrap">{label}</th>{"".join(cells)}</tr>'

        def cell(i: int, text: object, slot: int | None = None) -> str:
            if i >= len(req_ids):  # a padding token
                return f'<td style="{_CELL}; color:#999; background:#f3f3f3">pad</td>'
            color = request_color(req_ids[i])
            data = f' class="pkv-slot" data-slot="{slot}"' if slot is not None else ""
            return f'<td{data} style="{_CELL}; border-top:3px solid {color}">{esc(text)}</td>'

        def per_token(values: list[Any]) -> list[str]:
            return [cell(i, values[i] if i < len(req_ids) else "") for i in range(shown)]

        table = [row("request", per_token(req_ids)), row("token id", per_token(record.input_ids)),
                 row("position", per_token(record.positions))]
        for group in self.engine.kv_cache_groups:
            g, bs = group.group_id, group.spec.block_size
            suffix = f" (g{g})" if self.engine.num_kv_cache_groups > 1 else ""
            logical, physical, offset, slots = [], [], [], []
            for i in range(shown):
                slot = record.slot_mappings[g][i]
                if i >= len(req_ids) or slot < 0:
                    for cells in (logical, physical, offset):
                        cells.append(cell(i, ""))
                    slots.append(f'<td class="pkv-slot" data-slot="-1" style="{_CELL}; color:#999">-1</td>')
                    continue
                pos = record.positions[i]
                logical.append(cell(i, pos // bs))
                physical.append(cell(i, rows_by_req[req_ids[i]][g][pos // bs]))
                offset.append(cell(i, pos % bs))
                slots.append(cell(i, slot, slot))
            table += [
                row(f"pos // {bs}{suffix}", logical),
                row(f"block table{suffix}", physical),
                row(f"pos % {bs}{suffix}", offset),
                row(f"<b>slot</b>{suffix}", slots),
            ]
        more = f"<div>... {num_slots - shown} more tokens not drawn</div>" if num_slots > shown else ""
        return (
            f'<div class="pkv-slot-mapping" data-step="{record.step}" style="{BASE_STYLE}">'
            f"<div><b>step {record.step}</b> &middot; {record.num_tokens} tokens &middot; "
            f"slot = block_table[request][position // block_size] * block_size + position % block_size</div>"
            f'<div style="overflow-x:auto"><table style="border-collapse:collapse; margin-top:4px">'
            f'{"".join(table)}</table></div>{more}</div>'
        )
