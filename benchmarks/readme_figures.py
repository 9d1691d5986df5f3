"""The README's end-to-end figures, made from `end_to_end.py --json` files (never typed in).

    python benchmarks/readme_figures.py w1.json w2.json [...]     # prints markdown

Per workload and model one table; each row an engine in a mode (the mode asked for -> what the
engine resolved it to). Columns (those empty in every row are left out):

* start-up cold / warm s: `LLM(...)` in a fresh process with empty compile caches / with the
  caches the cold one filled (`--startup`);
* generate s, generate / stream out tok/s: the timed runs (output tokens / wall time);
* x nano-vllm (this run): generate and stream tok/s, both over nano-vllm's `generate` in the same
  process (W2, when it ran); x transformers: over transformers' `generate_batch` in the same run
  (W1, `--hf`). No ratio divides by a figure from another run;
* % roofline: generate tok/s over the roofline's (`workloads.roofline`);
* generate wall / GPU-busy s: the timed `generate`'s wall time / the kernel time summed over one
  more run of the same lengths under torch.profiler (`--kernel-profile`), and how much longer the
  wall is (the time the GPU waits for the host, at most). Two runs: the profiled one's own wall
  (`kernels.wall_s` in the JSON) is longer by the profiler's cost;
* decode step: median wall ms of a pure decode step at the workload's batch / GPU-busy ms /
  the host's share of the step.

`end_to_end.py` prints the same tables as plain text (`render(result, markdown=False)`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_bench import resolved_label  # noqa: E402

Table = tuple[str, list[str], list[list[str]]]
"""A title, the column names and the rows' cells."""


def _rate(run: dict | None) -> float | None:
    return run.get("output_tokens_per_s") if run else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else ""


def workload_table(w: dict) -> Table:
    rows = w["rows"]
    hf = next((_rate(r.get("generate")) for r in rows if "generate_batch" in r["engine"]), None)
    nano = next((_rate(r.get("generate")) for r in rows if r["engine"] == "nano-vllm"), None)
    roof = w.get("roofline") or {}
    columns = [
        "engine",
        "mode",
        "start-up cold / warm s",
        "generate s",
        "generate out tok/s",
        "stream out tok/s",
        "generate x nano-vllm (this run)",
        "stream x nano-vllm (this run)",
        "x transformers generate_batch (this run)",
        "% roofline",
        "generate wall / GPU-busy s",
        "decode step ms: wall / GPU-busy / host share",
    ]
    cells = []
    for r in rows:
        mode = r["mode"] + (f" -> {resolved_label(r['resolved'])}" if "resolved" in r else "")
        backends = (r.get("resolved") or {}).get("attention_backends")
        if backends:  # the default backend depends on what is installed (FLASH_ATTN where flash-attn 4 is)
            mode += ", " + " / ".join(backends)
        if "generate" not in r:
            cells.append([r["engine"], f"{mode}: {r.get('skipped') or r.get('error') or 'no result'}"] + [""] * 10)
            continue
        gen, stream, s, b = r["generate"], r.get("stream"), r.get("startup"), r.get("decode_breakdown")
        rate = _rate(gen)
        kernels = r.get("kernels") or {}
        busy = ""
        if kernels.get("gpu_s"):
            busy = f"{gen['seconds']:.2f} / {kernels['gpu_s']:.2f} (+{gen['seconds'] / kernels['gpu_s'] - 1:.0%})"
        breakdown = ""
        if b:
            gpu = "" if b["gpu_busy_ms"] is None else f" / {b['gpu_busy_ms']:.2f} / {b['host_share']:.0%}"
            breakdown = f"{b['step_wall_ms']:.2f}{gpu}"
        cells.append(
            [
                r["engine"],
                mode,
                f"{s['cold']['init_s']:.1f} / {s['warm']['init_s']:.1f}" if s else "",
                f"{gen['seconds']:.2f}",
                f"{rate:,.0f}",
                f"{_rate(stream):,.0f}" if stream else "",
                _ratio(rate, nano) if r["engine"] != "nano-vllm" else "",
                _ratio(_rate(stream), nano) if r["engine"] != "nano-vllm" else "",
                _ratio(rate, hf),
                f"{100 * rate / roof['output_tokens_per_s']:.0f}%" if roof.get("output_tokens_per_s") else "",
                busy,
                breakdown,
            ]
        )
    if roof.get("output_tokens_per_s"):
        cells.append(
            [
                "roofline",
                f"{roof['hbm_tbps']} TB/s, {roof['tflops']:.0f} TFLOP/s",
                "",
                f"{roof['seconds']:.2f}",
                f"{roof['output_tokens_per_s']:,.0f}",
            ]
            + [""] * 7
        )
    cached = sum(r[k].get("cached_prompt_tokens", 0) for r in rows for k in ("generate", "stream") if k in r)
    title = (
        f"{w['name']} on {w['model']}: {w['num_requests']} requests, {w['prompt_tokens']:,} prompt tokens, "
        f"{w['output_tokens']:,} output tokens, temperature {w['temperature']}, EOS ignored; "
        f"{', '.join(f'{k}={v}' for k, v in w['engine_args'].items())}; "
        + (
            "timed runs found none of their prompt tokens cached (prefix caching on)"
            if not cached
            else f"WARNING: timed runs found {cached} prompt tokens cached"
        )
    )
    return title, columns, cells


def decode_table(rows: list[dict]) -> Table:
    cells = [
        [
            r["model"],
            r["mode"],
            str(r.get("batch", "")),
            f"{r['step_ms']:.2f}" if "step_ms" in r else r.get("error", ""),
            r.get("resolved_mode", ""),
        ]
        for r in rows
    ]
    return "decode step latency (median wall time of llm.step())", ["model", "mode", "batch", "ms", "resolved"], cells


def tables(result: dict) -> list[Table]:
    out = [workload_table(w) for w in result.get("workloads", [])]
    if result.get("decode"):
        out.append(decode_table(result["decode"]))
    return out


def _drop_empty(columns: list[str], cells: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    keep = [i for i in range(len(columns)) if i < 2 or any(row[i] for row in cells)]
    return [columns[i] for i in keep], [[row[i] for i in keep] for row in cells]


def render(result: dict, markdown: bool = True) -> str:
    """Every table of one end_to_end.py result, as markdown or aligned plain text."""
    meta = result["meta"]
    lines = [
        f"{meta['date']}, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, transformers "
        f"{meta['transformers']}, commit {meta.get('git_commit')}: `{meta['command']}`"
    ]
    for title, columns, cells in tables(result):
        columns, cells = _drop_empty(columns, cells)
        lines += ["", title, ""]
        if markdown:
            lines.append("| " + " | ".join(columns) + " |")
            lines.append("|" + "|".join(" --- " if i < 2 else " ---: " for i in range(len(columns))) + "|")
            lines += ["| " + " | ".join(row) + " |" for row in cells]
        else:
            widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
            for row in [columns, *cells]:
                padded = enumerate(zip(row, widths, strict=True))
                lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in padded))
    return "\n".join(lines)


def main(paths: Sequence[str]) -> None:
    if not paths:
        sys.exit(__doc__)
    print("\n\n".join(render(json.loads(Path(p).read_text())) for p in paths))


if __name__ == "__main__":
    main(sys.argv[1:])
