"""Live views of a pagedkv engine for Jupyter (ipywidgets 8, HTML/SVG, matplotlib).

Imported as `pagedkv.widgets` (needs the `notebooks` extra). The source sits in the repository's
top-level `widgets/` folder; pyproject.toml installs it as `pagedkv/widgets`, and a clone used
without installing maps it by a small finder (see pagedkv/__init__.py).

Every view draws one step of a `pagedkv.trace.StepTrace`; the same code draws a step live
(the trace is attached to a running `LLM`) and replayed (a trace loaded from JSON):

    from pagedkv import LLM, SamplingParams
    from pagedkv.trace import StepTrace
    from pagedkv.widgets import BlockTableView, SlotMappingView, StepPlayer, plot_kv_cache_usage

    llm = LLM("tiny", num_kv_blocks=32)
    trace = StepTrace.attach(llm)                     # record every step from now on
    live = BlockTableView(trace)                      # index=-1: follows the newest step
    display(live)                                     # redraws while generate() runs
    llm.generate(["Hello", "paged attention"], SamplingParams(temperature=0, max_tokens=8))
    trace.detach()

    StepPlayer(trace, [BlockTableView(trace), SlotMappingView(trace)])   # slider + play
    plot_kv_cache_usage(trace)                        # matplotlib Axes
    trace.save("run.json"); StepTrace.load("run.json")   # replay elsewhere, e.g. a GPU run on a laptop

Shortcut: `BlockTableView.attach(llm)` makes the trace for you (`view.trace`).

Views (all `TraceView`s: an `ipywidgets.HTML` with an `index` trait, -1 = newest step; none is
wider than its output area):
    BlockTableView       physical blocks coloured by owner, free pool, null block, slots
                         written this step; each request's logical -> physical row; with prefix
                         caching (or `show_caching=True`), blocks shared by several requests,
                         evictable (free but cached) blocks, the free queue in eviction order and
                         the blocks a request found in the cache (double outline)
    SlotMappingView      each token: position -> block table -> slot (-1 = padding), a page of
                         tokens at a time (its `pager` slider pages through a long prefill)
    AttentionGroupsView  layers -> KV cache groups -> attention groups -> one metadata object
    ForwardContextView   per layer name: metadata, slot mapping, KV cache shape
    MLASplitView         an MLA model's step: which tokens went to forward_mqa (decodes, latent MQA)
                         and which to forward_mha (prefills, K/V up-projected), and where they meet
    SpecDecodeView       speculative decoding: per request with drafts, the proposed tokens, which the
                         target accepted (✓ / ✗), the tokens it emitted, and the KV slots of the step's
                         positions in its block-table row, the rejected ones written then rolled back
    PlotView             one of the plots below with a cursor at the step on display
StepPlayer(trace, views)   Play + IntSlider; renders every view at the chosen step, then updates the
                           views and the step label together (they always name the same step).
Watching a run: a view (or a player on its last step) following a run in a notebook draws every
step and holds each frame at least `min_frame_s` seconds (default 0.25: the engine waits, so 20
steps take 5 s and each can be seen); PAGEDKV_MIN_FRAME_S=0 in the environment (CI) or
`min_frame_s=0` skips frames instead and draws the newest step when the cell ends.
Colours: JupyterLab theme variables (`--jp-ui-font-color1`, `--jp-layout-color1`, ...) and request
colours of mid luminance, so every view reads in the light and the dark theme.
Plots: plot_kv_cache_usage, plot_batch_composition, plot_request_timeline, plot_throughput (each
returns its matplotlib Axes; legends sit outside the data).

Figures that follow the theme:
    show_figure(fig)     display a matplotlib Figure (or an Axes' figure) instead of plt.show():
                         a `ThemedFigure` widget holding a light and a dark rendering (greys
                         swapped, colours lightened to >= 3:1, text to >= 4.5:1 on the dark
                         background); CSS on `body[data-jp-theme-light]` shows the one of the
                         JupyterLab theme, with no kernel round trip. Saved with the notebook's
                         widget state, so a notebook that is just opened shows it too; its repr
                         is stable text for nbval. The figure is closed (no second, white copy).

        fig, ax = plt.subplots(figsize=(6, 3), layout="constrained")
        ax.plot(x, y, label="y")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))   # outside the data
        show_figure(fig)

Not tied to a trace:
    RequestRowsView      attached to a live LLM: which request holds which row of the model runner's
                         request state, each row's tokens, and what each step gathered from the rows
                         (per token its row, position, input id and slot); slider + play over the steps
    CudaGraphModeExplorer  CUDA graph mode, backend support, compile, decode query length,
                           enforce_eager -> the mode `resolve_cudagraph_mode` resolves and why
    PiecewiseSplitView     a compiled model's pieces and the attention ops run eagerly between them
    TensorParallelLayoutView  model shape + rank count -> each rank's heads (split or replicated),
                           its rows / columns of every matrix, its KV cache per token, the all-reduces
    MemoryAccessView       a Triton kernel's loads and stores per program id (an AccessLog of record_accesses)
    cache_bytes, latent_cache_table  MLA's cache per token per layer against the same model with MHA,
                           and how many tokens fit in a memory budget (notebook 11)
"""

try:
    import ipywidgets  # noqa: F401
    import matplotlib  # noqa: F401
except ImportError as error:  # the core package runs without Jupyter; the views need its extra
    raise ImportError(
        f"pagedkv.widgets needs ipywidgets and matplotlib ({error.name} is missing): pip install 'pagedkv[notebooks]'"
    ) from error

from pagedkv.widgets.attention_groups import AttentionGroupsView
from pagedkv.widgets.block_table import BlockTableView
from pagedkv.widgets.common import TraceView, request_color
from pagedkv.widgets.cudagraph import CudaGraphModeExplorer, PiecewiseSplitView
from pagedkv.widgets.figure import ThemedFigure, show_figure
from pagedkv.widgets.forward_context import ForwardContextView
from pagedkv.widgets.memory_access import MemoryAccessView
from pagedkv.widgets.mla import MLASplitView, cache_bytes, latent_cache_table
from pagedkv.widgets.player import StepPlayer
from pagedkv.widgets.plots import (
    PlotView,
    plot_batch_composition,
    plot_kv_cache_usage,
    plot_request_timeline,
    plot_throughput,
)
from pagedkv.widgets.request_rows import RequestRowsView
from pagedkv.widgets.slot_mapping import SlotMappingView
from pagedkv.widgets.spec_decode import SpecDecodeView
from pagedkv.widgets.tensor_parallel import TensorParallelLayoutView
from pagedkv.widgets.timeline import plot_step_breakdown, plot_step_timeline, timeline_figure

__all__ = [
    "AttentionGroupsView",
    "BlockTableView",
    "CudaGraphModeExplorer",
    "ForwardContextView",
    "MLASplitView",
    "MemoryAccessView",
    "PiecewiseSplitView",
    "PlotView",
    "RequestRowsView",
    "SlotMappingView",
    "SpecDecodeView",
    "StepPlayer",
    "TensorParallelLayoutView",
    "ThemedFigure",
    "TraceView",
    "cache_bytes",
    "latent_cache_table",
    "plot_batch_composition",
    "plot_kv_cache_usage",
    "plot_request_timeline",
    "plot_step_breakdown",
    "plot_step_timeline",
    "plot_throughput",
    "request_color",
    "show_figure",
    "timeline_figure",
]
