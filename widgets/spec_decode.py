"""`SpecDecodeView`: one step of speculative decoding, request by request: the drafts it verified,
which the target accepted, what it emitted, and the KV slots written and then rolled back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.checks import check_int
from pagedkv.trace import EngineInfo, RequestRecord, StepRecord, StepTrace
from pagedkv.widgets.common import (
    ACCENT,
    BASE_STYLE,
    BG,
    BG_HEADER,
    BORDER,
    FG,
    FG_MUTED,
    TraceView,
    esc,
    request_color,
)

if TYPE_CHECKING:
    from pagedkv.engine.llm import LLM

ACCEPTED, REJECTED = "✓", "✗"
"""Text glyphs (U+2713, U+2717) next to each draft: the verdict reads without its colour."""
ROLLED_BACK = f"2px dashed {FG_MUTED}"
"""A slot or block given back after the step: dashed, in the secondary text colour (both themes)."""


@dataclass(frozen=True)
class DraftSlot:
    """One position of a request's step with drafts: its token, what became of it, and its KV slots."""

    position: int
    token_id: int
    kind: str
    """"known" (the request's last token before the step: the target's pass starts from it), "accepted"
    or "rejected"."""
    slots: list[int]
    """Per KV cache group, the slot its K/V were written to in this step (block_id * block_size + offset)."""
    blocks: list[tuple[int, int, int]]
    """Per KV cache group, (logical block, physical block, offset in the block) of that slot."""


def draft_slots(record: StepRecord, request: RequestRecord, engine: EngineInfo) -> list[DraftSlot]:
    """The step's positions of a request with drafts, read off its input tokens and block-table row.

    Its query tokens are the last known token at position num_computed_tokens, then the drafts; the
    rejected drafts are the last ones, and their slots (written by this step) are rolled back.
    """
    start = 0  # the request's first token in the step: tokens are packed request after request
    for r in record.scheduled:
        if r is request:
            break
        start += r.num_new_tokens
    tokens = record.input_ids[start : start + request.num_new_tokens]
    accepted = request.num_accepted_tokens or 0
    out = []
    for i, token in enumerate(tokens):
        position = request.num_computed_tokens + i
        kind = "known" if i == 0 else ("accepted" if i <= accepted else "rejected")
        slots, blocks = [], []
        for g, group in enumerate(engine.kv_cache_groups):
            logical, offset = divmod(position, group.spec.block_size)
            physical = request.block_ids[g][logical]
            slots.append(physical * group.spec.block_size + offset)
            blocks.append((logical, physical, offset))
        out.append(DraftSlot(position, token, kind, slots, blocks))
    return out


class SpecDecodeView(TraceView):
    """Speculative decoding in one step: per request with drafts, one column per query position.

        position   40      41      42      43
        token      known   d1 ✓    d2 ✓    d3 ✗       emits d1 d2 t  (t: the target's correction)
        KV slot    163     164     165     166 (rolled back)

    The target's one pass computed logits for all of them; it accepted the longest prefix of drafts
    it agreed with and emitted one token of its own after them (a correction at the first rejected
    draft, a bonus when all were accepted). Every column's K/V was written in the step; the rejected
    ones' slots are rolled back: num_computed_tokens goes back past them and the next step writes
    those slots again. A block that held only rejected tokens is given back (drawn dashed).
    `decode` (a tokenizer's decode; `attach` takes the engine's) shows each token's text.
    """

    def __init__(
        self,
        trace: StepTrace,
        *,
        decode: Callable[[list[int]], str] | None = None,
        max_requests: int = 8,
        **kwargs: Any,
    ) -> None:
        self.decode = decode
        self.max_requests = check_int("max_requests", max_requests, 1, hint=" (requests drawn per step)")
        super().__init__(trace, **kwargs)

    @classmethod
    def attach(cls, llm: LLM, **kwargs: Any) -> SpecDecodeView:
        """A view on a new `StepTrace` recording `llm`, showing token text with the engine's tokenizer."""
        if llm.tokenizer is not None:
            kwargs.setdefault("decode", llm.tokenizer.decode)
        return cls(StepTrace.attach(llm), **kwargs)

    def render(self, record: StepRecord) -> str:
        speculated = [r for r in record.scheduled if r.draft_token_ids]
        others = [r for r in record.scheduled if not r.draft_token_ids]
        proposed = sum(len(r.draft_token_ids) for r in speculated)
        accepted = sum(r.num_accepted_tokens or 0 for r in speculated)
        if speculated:
            head = (
                f"<b>step {record.step}</b> &middot; {len(speculated)} request(s) verified {proposed} draft(s) "
                f"in one target pass: {accepted} accepted ({accepted / proposed:.0%}), "
                f"{accepted + len(speculated)} token(s) emitted"
            )
        else:
            head = f"<b>step {record.step}</b> &middot; no request verified drafts in this step"
        if others:
            listed = ", ".join(f"{r.req_id} ({'no draft' if r.phase == 'decode' else r.phase})" for r in others)
            head += f"<br><span style='color:{FG_MUTED}'>without drafts (query length as usual): {esc(listed)}</span>"
        shown = speculated[: self.max_requests]
        tables = "".join(self._request(record, r) for r in shown)
        if len(speculated) > len(shown):
            tables += f"<div>&hellip; {len(speculated) - len(shown)} more request(s) with drafts not drawn</div>"
        legend = _LEGEND if speculated else ""
        return (
            f'<div class="pkv-spec-decode" data-step="{record.step}" style="{BASE_STYLE}">'
            f"<div>{head}</div>{tables}{legend}</div>"
        )

    def _text(self, token_id: int) -> str:
        """The token's id, and its text when the view has a tokenizer (spaces and newlines made visible)."""
        if self.decode is None:
            return str(token_id)
        text = self.decode([token_id]).replace(" ", "␣").replace("\n", "↵")
        return f"{token_id} <b>{esc(text)}</b>"

    def _request(self, record: StepRecord, r: RequestRecord) -> str:
        color = request_color(r.req_id)
        slots = draft_slots(record, r, self.engine)
        block_sizes = [group.spec.block_size for group in self.engine.kv_cache_groups]
        cells: dict[str, list[str]] = {"position": [], "token": [], "KV slot": []}
        for s in slots:
            mark = {"known": "known", "accepted": f"{ACCEPTED} accepted", "rejected": f"{REJECTED} rejected"}[s.kind]
            rejected = s.kind == "rejected"
            border = ROLLED_BACK if rejected else f"2px solid {color}"
            cell = f"padding:1px 6px; text-align:center; border:{border}"
            cells["position"].append(
                f'<td style="padding:1px 6px; text-align:center; color:{FG_MUTED}">{s.position}</td>'
            )
            cells["token"].append(
                f'<td class="pkv-draft" data-kind="{s.kind}" style="{cell}; background:{BG}">'
                f"{self._text(s.token_id)}<br><span style='font-size:10px'>{mark}</span></td>"
            )
            struck = ' style="text-decoration: line-through"' if rejected else ""
            where = "<br>".join(
                f"{'g' + str(g) + ' ' if len(slots[0].slots) > 1 else ''}<span{struck}>{slot}</span> "
                f"<span style='color:{FG_MUTED}; font-size:10px'>= {phys}&times;{bs}+{off}</span>"
                for g, (slot, (_, phys, off), bs) in enumerate(zip(s.slots, s.blocks, block_sizes))
            )
            fate = "written, rolled back" if rejected else "written, kept"
            style = f"color:{FG_MUTED}" if rejected else ""
            cells["KV slot"].append(
                f'<td class="pkv-slot" data-kind="{s.kind}" data-slots="{",".join(map(str, s.slots))}" '
                f'title="{fate}" style="{cell}; {style}">{where}<br><span style="font-size:10px">{fate}</span></td>'
            )
        rows = "".join(
            f'<tr><th style="padding:1px 6px; text-align:left; background:{BG_HEADER}; font-weight:normal">{name}</th>'
            f"{''.join(row)}</tr>"
            for name, row in cells.items()
        )
        what = (
            f"req {esc(r.req_id)}: {r.num_computed_tokens} in the KV cache + {r.num_new_tokens} query tokens "
            f"(1 known + {len(r.draft_token_ids)} drafts)"
        )
        return (
            f'<div class="pkv-spec-request" data-req-id="{esc(r.req_id)}" style="margin-top:8px">'
            f'<div><span style="display:inline-block; width:9px; height:9px; background:{color}"></span> '
            f"{what}</div>"
            f'<div style="max-width:100%; overflow-x:auto"><table style="border-collapse:separate; border-spacing:2px; font-size:inherit">'
            f"{rows}</table></div>{self._emitted(r)}{self._block_row(r, slots)}</div>"
        )

    def _emitted(self, r: RequestRecord) -> str:
        accepted = r.num_accepted_tokens or 0
        if r.num_rejected_tokens:
            own = f"a correction: the target's token where draft {accepted + 1} was rejected"
        else:
            own = "a bonus: every draft was accepted, and the last position's logits give one more"
        if not r.emitted_token_ids:
            return f"<div>emitted: {accepted} accepted draft(s), then the target's own token ({own})</div>"
        tokens = " ".join(
            f"<span style='border-bottom:2px solid {ACCENT}'>{self._text(t)}</span>" if i == accepted else self._text(t)
            for i, t in enumerate(r.emitted_token_ids)
        )
        cut = " (the request finished on the way)" if len(r.emitted_token_ids) < accepted + 1 else ""
        return (
            f'<div class="pkv-emitted">emitted: {tokens}{cut} <span style="color:{FG_MUTED}">'
            f"= {accepted} accepted draft(s) + {own}</span></div>"
        )

    def _block_row(self, r: RequestRecord, slots: list[DraftSlot]) -> str:
        """Each group's block-table row: the blocks this step wrote outlined, those given back dashed."""
        lines = []
        for g, row in enumerate(r.block_ids):
            touched = {s.blocks[g][1] for s in slots}
            given_back = set(r.rolled_back_block_ids[g]) if g < len(r.rolled_back_block_ids) else set()
            boxes = []
            for j, block in enumerate(row):
                if block in given_back:
                    border, tip = ROLLED_BACK, "given back after the step: it held only rejected tokens"
                elif block in touched:
                    border, tip = f"2px solid {ACCENT}", "written by this step"
                else:
                    border, tip = f"1px solid {BORDER}", "not touched by this step"
                mark = f" {REJECTED}" if block in given_back else ""
                boxes.append(
                    f'<span class="pkv-row-cell" data-block="{block}" title="logical block {j} -> physical block '
                    f'{block}: {tip}" style="display:inline-block; min-width:22px; margin:1px; text-align:center; '
                    f'border:{border}"><span style="font-size:9px; color:{FG_MUTED}">{j}</span><br>{block}{mark}</span>'
                )
            prefix = f"g{g} " if len(r.block_ids) > 1 else ""
            lines.append(f"{prefix}{''.join(boxes)}")
        return f'<div style="color:{FG}">block table: {"<br>".join(lines)}</div>'


_LEGEND = (
    f'<div style="color:{FG_MUTED}; margin-top:6px">columns = the step\'s query positions: the known token, '
    f"then the drafts; {ACCEPTED} = accepted (the target's own choice there), {REJECTED} = rejected (dashed). "
    "Every column's K/V was written this step; struck-through slots are rolled back and written again next step. "
    "Underlined in the emitted tokens: the target's own token. Block table: accent = written this step, "
    f"dashed {REJECTED} = given back.</div>"
)
