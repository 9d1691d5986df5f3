"""Notebook 00 (start here): what this machine offers, and the first exercise.

`environment_report()` lists versions and devices, `runs_here(needs)` says how a notebook runs here,
`html_table(...)` draws the notebooks' tables, and `check_choose_backend(llm, fn)` checks the
student's own version of the selector's rule, `fn(priority, reasons) -> name or None`, on the live
engine's layer 0 and on cases of its own, and explains the engine's choice.
"""

from __future__ import annotations

import functools
import importlib
import os
import platform
import random
import sys
from collections.abc import Callable, Iterable, Sequence

import torch

from pagedkv.attention.selector import ENV_VAR, backend_report, get_attn_backend
from pagedkv.engine.llm import LLM
from pagedkv.exercises import CheckResult, Either, call_on_cases, exercise, package_answer, plain
from pagedkv.platforms import default_device, get_platform
from pagedkv.widgets.common import BG_HEADER, BORDER_LIGHT, FG, esc


def _package_version(module: str) -> str:
    """`module.__version__`, or why it cannot be imported."""
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as exc:  # noqa: BLE001  (ImportError, or a broken install raising something else)
        return f"not available ({type(exc).__name__})"


def environment_report() -> dict[str, str]:
    """What the workbook can use here: Python, torch, the device, triton, flash-attn."""
    device = default_device()
    report = {
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu cores": str(os.cpu_count()),
        "torch": torch.__version__,
        "default device": str(device),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report["gpu"] = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})"
        report["cuda (torch built with)"] = str(torch.version.cuda)
    else:
        report["gpu"] = "none visible"
    report["triton"] = _package_version("triton")
    report["flash-attn"] = _package_version("flash_attn")
    flavour = _flash_attn_flavour()
    if flavour is not None:
        report["flash-attn"] += f" (the FLASH_ATTN backend would use flash-attn {flavour})"
    return report


def _flash_attn_flavour() -> int | None:
    """Which flash-attn the FLASH_ATTN backend would use here (4 or 2), or None."""
    try:
        from pagedkv.attention.backends.flash_attn import flash_attn_version
    except ImportError:
        return None
    return flash_attn_version()


def runs_here(needs: str) -> str:
    """How a notebook with requirement `needs` (`pagedkv.workbook.NotebookInfo.needs`) runs here, in a few words."""
    cuda = torch.cuda.is_available()
    if needs == "cpu":
        return "yes" + (" (on the GPU)" if cuda else " (on the CPU)")
    if needs == "triton":
        if "not available" in _package_version("triton"):
            return "no: triton is not installed"
        if cuda:
            return "yes (native kernels)"
        return "yes, in the Triton interpreter (TRITON_INTERPRET=1): slow, tiny shapes"
    if needs == "cuda":
        return "yes" if cuda else "no: needs a CUDA GPU"
    if needs == "flash-attn":
        if not cuda:
            return "no: needs a CUDA GPU with flash-attn"
        flavour = _flash_attn_flavour()
        return f"yes (flash-attn {flavour})" if flavour is not None else "no: flash-attn is not installed"
    raise ValueError(f"Unknown requirement {needs!r}.")


def html_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """Rows as an HTML table that fits a notebook column and follows the JupyterLab theme.

    A printed fixed-width table wraps every row in a narrow window; an HTML table wraps inside its
    cells, and only in long ones (a short cell such as "MHA 32/32" stays on one line). `align`
    holds one letter per column, "l" or "r" (default: all left).
    """

    def row(cells: Sequence[object], tag: str, style: str) -> str:
        sides = ["right" if align[i : i + 1] == "r" else "left" for i in range(len(cells))]
        return (
            "<tr>"
            + "".join(
                f'<{tag} style="{style} text-align:{side};{" white-space:nowrap;" if len(str(cell)) <= 24 else ""}">'
                f"{esc(cell)}</{tag}>"
                for cell, side in zip(cells, sides)
            )
            + "</tr>"
        )

    cell = f"padding:2px 8px; border-bottom:1px solid {BORDER_LIGHT}; vertical-align:top;"
    body = "".join(row(r, "td", cell) for r in rows)
    return (
        f'<table style="border-collapse:collapse; max-width:100%; font-size:12px; color:{FG}">'
        f"<thead>{row(header, 'th', f'background:{BG_HEADER}; {cell}')}</thead><tbody>{body}</tbody></table>"
    )


# Names and refusal reasons the made-up cases of check_choose_backend are drawn from: no platform has
# these priority lists and "MY_ATTN" is no registered backend, so the package's selector cannot answer them.
_NAMES = ("TORCH_REF", "TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "MY_ATTN")
_REASONS = (
    "device 'cpu' not supported",
    "head size 100 not supported",
    "block size 7 not supported",
    "dtype torch.float32 not supported",
    "sliding window not supported",
)

ChooseFn = Callable[[list[str], dict[str, list[str]]], object]
Case = tuple[list[str], dict[str, list[str]]]


def _why_chosen(llm: LLM, layer_name: str, chosen: str, report: dict[str, list[str]]) -> str:
    """The selector's decision for `layer_name` of `llm`, in words."""
    forced = llm.config.attention_backend or os.environ.get(ENV_VAR)
    if forced:
        return f"the engine was told to use {forced!r} (LLM(attention_backend=...) or ${ENV_VAR})"
    priority = list(get_platform(llm.config.device).backend_priority)
    tried_before = priority[: priority.index(chosen)] if chosen in priority else []
    rejected = [f"{n} ({'; '.join(report[n])})" for n in tried_before if n in report]
    why = f"on {llm.config.device.type} the selector tries {priority} in order and takes the first that can serve it"
    return why + ("; rejected before it: " + ", ".join(rejected) if rejected else "")


def _random_case(rng: random.Random) -> Case:
    """A priority list and a report (in another order) where the answer is rarely the first name."""
    priority = rng.sample(_NAMES, rng.randint(2, 4))
    reasons = {n: rng.sample(_REASONS, rng.randint(0, 2)) if rng.random() < 0.6 else [] for n in _NAMES}
    rng.shuffle(names := list(reasons))
    return priority, {n: reasons[n] for n in names}


@exercise("00: be the selector")
def check_choose_backend(
    llm: LLM, fn: ChooseFn, layer_name: str = "model.layers.0.self_attn.attn", num_hidden: int = 20
) -> CheckResult:
    """Does `fn(priority, reasons)` pick a layer's backend the way the selector does?

    `priority` is the platform's list of backend names, `reasons` maps every registered backend to
    its reasons for refusing the layer (empty: it can serve it). The answer is the first name of
    `priority` with no reasons, or None. Tried on `layer_name` of `llm` (its real priority list and
    report), on a case where every backend refuses, then on `num_hidden` random cases drawn afresh on
    each call (with a backend no registry knows). All calls run before any answer is worked out.
    """
    own = package_answer(fn, [get_attn_backend], "the rule")
    if own is not None:
        return own
    if layer_name not in llm.runner.attn_layers:
        return CheckResult(False, f"{layer_name!r} is not an attention layer; they are {list(llm.runner.attn_layers)}.")
    report = backend_report(llm.config.device, **llm.runner.attn_layers[layer_name].selector_kwargs())
    rng = random.Random()
    cases: list[Case] = [
        (list(get_platform(llm.config.device).backend_priority), report),
        # Always tried, as None is rare at random: both listed backends refuse, one not listed could serve.
        (["TRITON_ATTN", "FLASH_ATTN"], {"TORCH_REF": [], "TRITON_ATTN": [_REASONS[1]], "FLASH_ATTN": [_REASONS[0]]}),
        *(_random_case(rng) for _ in range(num_hidden)),
    ]
    # The student's function gets copies, so it cannot change a case before its answer is worked out.
    answers, rejected = call_on_cases(
        fn,
        [(list(p), {n: list(r) for n, r in rs.items()}) for p, rs in cases],
        [get_attn_backend],
        "the rule",
        lambda case: f"fn({case[0]}, ...)",
    )
    if rejected is not None:
        return rejected

    # The rules, worked out here and only now that the student's code has run: nothing a student
    # could import or find in a frame while the function runs.
    def mistake(got: object, priority: list[str], reasons: dict[str, list[str]]) -> str | None:
        """Which rule of the selector `got` breaks for this case, in one sentence (None: it breaks none).

        Each rule is checked on its own, so the message names the rule without naming the answer.
        """
        servable = [n for n in priority if not reasons.get(n)]
        try:  # a plain str: an answer's own == takes no part in the comparisons
            got = plain(got, Either(("", None)))
        except TypeError:
            return f"you returned a {type(got).__name__}: return the name of a backend (a str), or None"
        if got is None:
            return "you returned None, but a backend in the priority list can serve the layer" if servable else None
        if got not in reasons:
            return f"you returned {got!r}, which names no backend: return one from the priority list, or None"
        if reasons[got]:
            return f"you returned {got}, which refuses the layer: a backend with reasons is skipped"
        if got not in priority:
            return f"you returned {got}: it could serve the layer, but only backends in the priority list are tried"
        if servable[0] != got:
            return (
                f"you returned {got}: it can serve the layer, but so can a backend earlier in the priority list, "
                "and the selector takes the first"
            )
        return None

    def worked_choice(priority: list[str], reasons: dict[str, list[str]]) -> str:
        """The selector's walk down `priority` for this case, one line per backend tried."""
        lines = [f"priority {priority}, tried in order:"]
        for name in priority:
            if reasons.get(name):
                lines.append(f"  {name}: refuses ({'; '.join(reasons[name])}) -> skip")
            else:
                lines.append(f"  {name}: no reasons -> the selector takes it")
                return "\n".join([*lines, f"answer: {name!r}"])
        return "\n".join([*lines, "  every backend in the list refuses -> answer: None"])

    def shown(priority: list[str], reasons: dict[str, list[str]]) -> str:
        """The case in short: only whether each backend has reasons matters to the rule."""
        serve, refuse = [n for n in reasons if not reasons[n]], [n for n in reasons if reasons[n]]
        return f"priority {priority}; can serve: {', '.join(serve) or 'none'}; refuse: {', '.join(refuse) or 'none'}"

    for answer, (priority, reasons) in zip(answers, cases):
        broken = mistake(answer, priority, reasons)
        if broken is not None:
            return CheckResult(
                False,
                f"For {shown(priority, reasons)}: {broken}.",
                reveal=functools.partial(worked_choice, priority, reasons),
            )
    chosen = llm.runner.attn_layers[layer_name].attn_backend.get_name()
    return CheckResult(
        True,
        f"Your rule agrees with the selector on {len(cases)} cases. On this machine "
        f"{chosen} serves {layer_name!r}: {_why_chosen(llm, layer_name, chosen, report)}.",
    )
