"""`TensorParallelLayoutView`: which heads and which slice of every matrix each tensor-parallel rank holds."""

from __future__ import annotations

from typing import Any

import ipywidgets

from pagedkv.models.configs import LlamaConfig
from pagedkv.models.layers import head_layout, rank_heads
from pagedkv.models.loader import PRESETS
from pagedkv.widgets.common import ACCENT, BASE_STYLE, BG_HEADER, BORDER, FG_MUTED, dropdown_size, esc

# Shapes of public checkpoints (config.json values), to pick from; one model a line. Llama-3-8B is the
# "llama3-8b" preset itself, so the widget and the benchmarks' model cannot disagree on its shape.
# fmt: off
SHAPES: dict[str, LlamaConfig] = {
    "Llama-3-8B (32 q / 8 kv heads)": PRESETS["llama3-8b"],
    "Llama-3-70B (64 q / 8 kv heads)": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
    "Qwen2-7B (28 q / 4 kv heads)": LlamaConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
    "Llama-2-7B, MHA (32 q / 32 kv heads)": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    "an MQA model (32 q / 1 kv head)": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=1),
}
# fmt: on

DATAFLOW = """\
x (whole, on every rank)
 ├─ qkv_proj     column-parallel: this rank's q heads and KV head(s)   no communication
 ├─ attention    on those heads only, against this rank's KV cache
 ├─ o_proj       row-parallel: partial sums over this rank's heads
 ├─ all-reduce   (1)  [tokens, hidden]
 ├─ gate_up_proj column-parallel: this rank's columns of the MLP       no communication
 ├─ down_proj    row-parallel: partial sums
 └─ all-reduce   (2)  [tokens, hidden]       -> x for the next layer, whole on every rank again"""


def _span(heads: range) -> str:
    return str(heads.start) if len(heads) == 1 else f"{heads.start}-{heads.stop - 1}"


def _row(values: list[str], tag: str, style: str = "") -> str:
    cells = "".join(f'<{tag} style="padding: 2px 8px; border: 1px solid {BORDER}; {style}">{v}</{tag}>' for v in values)
    return f"<tr>{cells}</tr>"


def layout_table(model: LlamaConfig, tp_size: int, dtype_bytes: int = 2) -> str:
    """HTML: one row per rank (heads, the rows / columns of each matrix, KV cache per token)."""
    layout = head_layout(model.num_attention_heads, model.num_key_value_heads, tp_size)  # raises when it cannot split
    d = model.head_dim
    inter, vocab = model.intermediate_size // tp_size, -(-model.vocab_size // tp_size)
    kv_per_token = 2 * layout.num_kv_heads * d * dtype_bytes * model.num_hidden_layers
    header = [
        "rank",
        "query heads",
        "KV heads",
        "qkv_proj rows (q + k + v)",
        "o_proj input columns",
        "gate_up_proj rows",
        "down_proj input columns",
        "vocabulary rows (embedding, LM head)",
        "KV cache per token",
    ]
    rows = [_row(header, "th", f"background: {BG_HEADER}")]
    for rank in range(tp_size):
        q, kv = rank_heads(layout, rank)
        shared = (
            f" <span style='color: {FG_MUTED}'>(on {layout.kv_head_replicas} ranks)</span>"
            if layout.kv_head_replicas > 1
            else ""
        )
        values = [
            str(rank),
            _span(q),
            _span(kv) + shared,
            f"{len(q) * d} + {len(kv) * d} + {len(kv) * d}",
            f"{q.start * d}-{q.stop * d - 1}",
            f"{rank * inter}-{(rank + 1) * inter - 1} of each",
            f"{rank * inter}-{(rank + 1) * inter - 1}",
            f"{rank * vocab}-{min((rank + 1) * vocab, model.vocab_size) - 1}",
            f"{kv_per_token:,} B",
        ]
        rows.append(_row(values, "td"))
    reduce_bytes = model.hidden_size * dtype_bytes
    return (
        f'<div class="pkv-tensor-parallel" data-tp="{tp_size}" style="{BASE_STYLE}">'
        f"<table style='border-collapse: collapse'>{''.join(rows)}</table>"
        f"<div style='margin-top: 6px'>Per token and layer, each rank sends its share of "
        f"<b style='color: {ACCENT}'>2 all-reduces</b> of {reduce_bytes:,} B (hidden {model.hidden_size} x "
        f"{dtype_bytes} B); the embedding adds one more per step and the LM head one all-gather of logits.</div>"
        f"<pre style='margin-top: 6px'>{esc(DATAFLOW)}</pre></div>"
    )


TP_SIZES = [1, 2, 4, 8, 16]

LABEL_PX = 50
"""Width of a dropdown's description ("model", "tp")."""


def _dropdown(options: list[Any], value: Any, description: str) -> ipywidgets.Dropdown:
    """A dropdown as wide as its longest choice, so a picked model can be read whole."""
    longest = max(len(str(option)) for option in options)
    return ipywidgets.Dropdown(
        options=options, value=value, description=description, **dropdown_size(longest, LABEL_PX)
    )


class TensorParallelLayoutView(ipywidgets.VBox):
    """Pick a model shape and a rank count; see what each rank holds and where ranks talk."""

    def __init__(self, shape: str = next(iter(SHAPES)), tp_size: int = 2, **kwargs: Any) -> None:
        for name, value, options in (("shape", shape, list(SHAPES)), ("tp_size", tp_size, TP_SIZES)):
            if value not in options:
                raise ValueError(f"{name} {value!r} is not one of the choices {options}.")
        self.shape = _dropdown(list(SHAPES), shape, "model")
        self.tp = _dropdown(TP_SIZES, tp_size, "tp")
        self.html = ipywidgets.HTML()
        # A row that wraps: in a narrow output area the rank count goes below the model, whole.
        controls = ipywidgets.HBox([self.shape, self.tp], layout=ipywidgets.Layout(flex_flow="row wrap"))
        super().__init__([controls, self.html], **kwargs)
        for control in (self.shape, self.tp):
            control.observe(lambda _: self.redraw(), "value")
        self.redraw()

    def redraw(self) -> None:
        try:
            self.html.value = layout_table(SHAPES[self.shape.value], self.tp.value)
        except ValueError as error:  # a rank count the heads do not allow: say why
            self.html.value = f'<div class="pkv-tensor-parallel" style="{BASE_STYLE}">Cannot split: {esc(error)}</div>'
