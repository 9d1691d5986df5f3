"""Command line: `python -m pagedkv {generate,backends,workbook,lab} ...`."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
import typing
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from pagedkv import LLM, SamplingParams, StepEvent
from pagedkv.engine.arg_utils import CLI_ARGS, add_cli_args
from pagedkv.engine.llm import Prompt
from pagedkv.entrypoints.cli import add_serve_parser
from pagedkv.plugins import load_plugin
from pagedkv.workbook import DEFAULT_DIR as DEFAULT_WORKBOOK_DIR

BACKENDS_ENGINE_ARGS = ["model", "device", "dtype", "block_size", "kv_cache_dtype"]
"""The `EngineArgs` that decide which backends can serve a layer (`backends` takes these)."""


def _token_ids(text: str) -> list[int]:
    """ "1,2,3" -> [1, 2, 3]; anything else is a ValueError naming the option."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--prompt-token-ids {text!r}: expected integer token ids separated by commas, such as 1,2,3."
        ) from None


def _prompts(args: argparse.Namespace) -> list[Prompt]:
    """--prompt / --prompt-token-ids in the order given, repeated --n times."""
    if not args.prompts:
        raise ValueError("give at least one --prompt TEXT or --prompt-token-ids 1,2,3.")
    if args.n < 1:
        raise ValueError(f"--n must be >= 1 (copies of the prompts), got {args.n}.")
    prompts: list[Prompt] = [p if kind == "text" else {"prompt_token_ids": _token_ids(p)} for kind, p in args.prompts]
    return prompts * args.n


def _show_steps(llm: LLM) -> None:
    # prefill: prompt (and recomputed) tokens computed in the step; cached: tokens found in the prefix cache instead.
    print(f"{'step':>4} {'reqs':>4} {'prefill':>7} {'cached':>6} {'decode':>6} {'blocks used/free':>16} {'preempt':>7}")

    def show(event: StepEvent) -> None:
        sched = event.scheduler_output
        free = event.num_free_blocks[0]
        used = llm.kv_cache_manager.num_usable_blocks - free
        cached = sum(s.num_cached_tokens for s in sched.scheduled)
        print(
            f"{event.step:>4} {len(sched.scheduled):>4} {sched.num_prefill_tokens:>7} {cached:>6} "
            f"{sched.num_decode_tokens:>6} {f'{used}/{free}':>16} {len(sched.preempted_req_ids):>7}"
        )

    llm.add_step_listener(show)


def _stream(llm: LLM, prompts: list[Prompt], params: SamplingParams) -> list[str]:
    """Drive the engine step by step, printing each new token as `[request id] token_id 'text'`;
    returns the errors of the requests that failed."""
    for prompt in prompts:
        llm.add_request(prompt, params)
    errors = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            completion = out.outputs[0]
            if completion.token_ids:
                token = completion.token_ids[-1]
                piece = llm.tokenizer.decode([token]) if llm.tokenizer is not None else ""
                print(f"[{out.request_id}] {token} {piece!r}", flush=True)
            if out.error is not None:
                errors.append(out.error)
                print(f"[{out.request_id}] failed: {out.error}", flush=True)
            elif out.finished:
                print(f"[{out.request_id}] done ({completion.finish_reason}): {completion.text!r}", flush=True)
    return errors


def _generate(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    # Every engine option, defaults included (EngineArgs' own, so the CLI picks none itself).
    llm = LLM(args.model, **{name: getattr(args, name) for name in CLI_ARGS if name != "model"})
    if args.show_steps:
        _show_steps(llm)
    start = time.perf_counter()
    if args.stream:
        errors = _stream(llm, prompts, params)
    else:
        errors = []
        for out in llm.generate(prompts, params):
            print(out.outputs[0].text)
            if out.error is not None:
                errors.append(out.error)
                print(f"# request {out.request_id} failed: {out.error}", file=sys.stderr)
    elapsed = time.perf_counter() - start
    s = llm.stats
    caching = (
        f"{s.num_cached_tokens} prompt tokens from the prefix cache ({s.prefix_cache_hit_rate:.0%} hit rate)"
        if llm.prefix_caching
        else "prefix caching off"
    )
    if llm.speculative_config is not None:
        caching += (
            f", {s.num_accepted_tokens} of {s.num_draft_tokens} drafts accepted ({s.acceptance_rate:.0%}; "
            f"{s.mean_accepted_length:.2f} tokens per verifying step)"
        )
    print(
        f"# {s.num_steps} steps, {s.num_prefill_tokens} prefill + {s.num_decode_tokens} decode tokens, {caching}, "
        f"{s.num_preemptions} preemptions, {elapsed:.2f} s, cudagraph_mode {llm.runner.cudagraph_mode.name}",
        file=sys.stderr,
    )
    llm.shutdown()
    if len(errors) == len(prompts):  # nothing came out: a script must not read that as success
        first = " ".join(errors[0].split())
        print(f"pagedkv: error: all {len(prompts)} requests failed; the first: {first}", file=sys.stderr)
        return 1
    return 0


def _backends(args: argparse.Namespace) -> None:
    from pagedkv.attention.selector import backend_report
    from pagedkv.checks import check_int
    from pagedkv.config import parse_kv_cache_dtype
    from pagedkv.engine.checks import check_device, check_dtype, check_model
    from pagedkv.models.loader import PRESETS, TRAINED_PRESETS, load_config

    # The engine's own checks: a device that is not here, or a block size below 1, is refused as LLM() refuses it.
    device = check_device(args.device)
    block_size = check_int("--block-size", args.block_size, 1, hint=" (tokens per KV cache block)")
    cfg = load_config(check_model(args.model, sorted([*PRESETS, *TRAINED_PRESETS])))
    dtype = check_dtype(args.dtype, device)
    kv_cache_dtype = parse_kv_cache_dtype(args.kv_cache_dtype, dtype)
    layer = dict(
        head_size=cfg.head_dim,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        sliding_window=cfg.sliding_window,
        use_mla=cfg.use_mla,
    )
    print(
        f"model {args.model}: {'MLA, latent row' if cfg.use_mla else 'head'} size {cfg.head_dim}, dtype {dtype}, "
        f"KV cache {kv_cache_dtype}, block size {block_size}, sliding window {cfg.sliding_window}, device {device.type}"
    )
    report = backend_report(device, **layer)
    width = max(map(len, report))
    for name, reasons in report.items():
        print(f"  {name:<{width}}  {'ok' if not reasons else '; '.join(reasons)}")


def _workbook(args: argparse.Namespace) -> int:
    from pagedkv import workbook

    if args.list:
        for nb in workbook.list_notebooks():
            labels = {"cpu": "CPU or GPU", "triton": "Triton"}
            needs = "needs a GPU" if nb.requires_gpu else labels.get(nb.needs, nb.needs)
            print(f"{nb.name:<34} {needs:<12} {nb.topic}")
        return 0
    dest = Path(args.dir)
    report = workbook.copy_workbook(dest, force=args.force)
    print(f"workbook in {dest.resolve()}: {len(report.copied)} files copied, {len(report.unchanged)} already there")
    for rel in report.kept:
        print(f"  kept your copy of {rel} (it differs from the shipped one; --force replaces it)")
    for rel in report.links:
        print(f"  left the symbolic link {rel} alone (never written through; --force replaces the link itself)")
    if args.lab or (workbook.has_display() and not args.execute):
        workbook.open_lab(dest)
    for rel in [*report.kept, *report.links]:
        if rel.suffix == ".ipynb":
            print(f"skip {rel.name} (your copy: its saved outputs are kept; --force replaces and runs it)")
    runnable = [rel for rel in [*report.copied, *report.unchanged] if rel.suffix == ".ipynb"]
    failed = []

    def say(line: str, file: TextIO = sys.stdout) -> None:
        tqdm.write(line, file=file)  # above the progress bars, which stay at the bottom of the terminal
        file.flush()  # now, also into a pipe or a log

    for run in workbook.execute_workbook(dest, sorted(runnable), cuda=_cuda()):
        if run.error is not None:
            failed.append(run.name)
            say(f"pagedkv: error: notebook {run.name} failed {run.error} (not saved)", file=sys.stderr)
        elif run.skipped is not None:
            say(f"skip {run.name} ({run.skipped})")
        else:
            say(f"ran  {run.name} in {run.seconds:.1f} s")
    print(f"The executed notebooks are in {dest / 'notebooks'}; open them with: {_command()} workbook {args.dir} --lab")
    if failed:
        print(
            f"pagedkv: error: {len(failed)} of {len(runnable)} notebooks failed: {', '.join(failed)}", file=sys.stderr
        )
        return 1
    return 0


def _lab(args: argparse.Namespace) -> int:
    from pagedkv.exercises import labs

    if args.lab_command == "list":
        for lab in labs.LABS.values():
            print(f"{lab.name:<18} {lab.notebook:<34} {labs.writes(lab)}")
        return 0
    lab = labs.find_lab(args.name)
    if args.lab_command == "start":
        path = Path(args.file or f"{lab.name.replace('-', '_')}.py")
        if path.exists() and not args.force:
            raise FileExistsError(f"{path} exists (your work?); name another file, or --force replaces it")
        path.write_text(labs.starter(lab, path), encoding="utf-8")
        print(f"wrote {path}: fill in {', '.join(lab.defines)}, then: pagedkv lab check {lab.name} {path}")
        return 0
    result = labs.check_file(lab, Path(args.file))
    print(repr(result))  # the notebook's line: ✓ or ✗, then the message
    return 0 if result.ok else 1


def _command() -> str:
    """How to run pagedkv again from this shell: `pagedkv` where that name finds this installation,
    else the full path of its script (a venv that is not activated: `pagedkv` there is "command not
    found"), else `python -m pagedkv` with this interpreter."""
    script = Path(sys.executable).parent / "pagedkv"
    found = shutil.which("pagedkv")
    if found is not None and script.is_file() and Path(found).resolve() == script.resolve():
        return "pagedkv"
    return shlex.quote(str(script)) if script.is_file() else f"{shlex.quote(sys.executable)} -m pagedkv"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the whole usage first, ~25 lines for
    `generate`), as every other mistake is; `--help` still prints it all. Sub-command parsers are
    made of the same class (add_subparsers' default parser_class)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"pagedkv: error: {message} ({self.prog} --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m pagedkv`: one sub-command each for generate, backends, workbook and lab."""
    parser = _OneLineErrorParser(prog="pagedkv", description=__doc__)
    debug_help = "show the traceback of an error instead of one line (or set PAGEDKV_DEBUG=1)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    # Also after the command (`pagedkv generate ... --debug`); SUPPRESS keeps the top-level value when absent.
    common = _OneLineErrorParser(add_help=False)  # parents share the subparsers' class
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    # The sub-commands that build an engine can import the user's code first (pagedkv/plugins.py).
    plugins = _OneLineErrorParser(add_help=False)
    plugins.add_argument(
        "--load",
        action="append",
        default=[],
        metavar="FILE.py|MODULE",
        help="import this Python file or module first (may be given several times), e.g. one that calls "
        "register_backend(MyBackend), so that --attention-backend MY_BACKEND can name it",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        parents=[common, plugins],
        help="generate text, optionally streaming tokens or showing every engine step",
        description="The engine options are LLM's arguments (pagedkv.engine.arg_utils.EngineArgs); "
        'one left out keeps LLM\'s default, and "None: ..." says what that picks.',
    )
    add_cli_args(gen, CLI_ARGS)
    gen.add_argument(
        "--prompt",
        dest="prompts",
        action="append",
        type=lambda text: ("text", text),
        default=[],
        metavar="TEXT",
        help="a text prompt; may be given several times",
    )
    gen.add_argument(
        "--prompt-token-ids",
        dest="prompts",
        action="append",
        type=lambda ids: ("ids", ids),
        metavar="1,2,3",
        help="one prompt as comma-separated token ids; may be given several "
        "times (one prompt each), mixed with --prompt in the order given",
    )
    gen.add_argument("--n", type=int, default=1, help="repeat the prompts n times (a bigger batch)")
    # The CLI's own sampling defaults (greedy, 32 tokens: a reproducible look at a model); seed is SamplingParams'.
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default %(default)s)")
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy (default %(default)s)"
    )
    gen.add_argument("--seed", type=int, default=SamplingParams.seed, help="sampling seed (SamplingParams.seed)")
    gen.add_argument(
        "--show-steps",
        action="store_true",
        help="print a table row per engine step (prefill: prompt tokens computed; cached: "
        "tokens found in the prefix cache instead)",
    )
    gen.add_argument(
        "--stream", action="store_true", help="print every token as its step produces it: [request id] token_id 'text'"
    )
    gen.set_defaults(func=_generate)

    be = sub.add_parser(
        "backends", parents=[common, plugins], help="which attention backends can serve this model here, and why not"
    )
    add_cli_args(be, BACKENDS_ENGINE_ARGS)
    be.set_defaults(func=_backends)

    wb = sub.add_parser(
        "workbook",
        parents=[common],
        help="copy the workbook into DIR, then open it in JupyterLab (no display: execute every notebook)",
    )
    wb.add_argument(
        "dir",
        nargs="?",
        default=str(DEFAULT_WORKBOOK_DIR),
        help=f"where the notebooks go (default ./{DEFAULT_WORKBOOK_DIR})",
    )
    wb.add_argument("--list", action="store_true", help="list the notebooks and which need a GPU, then stop")
    wb.add_argument("--force", action="store_true", help="replace copies in DIR that differ from the shipped ones")
    wb.add_argument("--lab", action="store_true", help="always open JupyterLab")
    wb.add_argument("--execute", action="store_true", help="always execute every notebook (saved with outputs)")
    wb.set_defaults(func=_workbook)

    lab = sub.add_parser(
        "lab",
        parents=[common],
        help="the workbook's exercises as files: list them, write a starter, grade a file (exit 0: it passes)",
        description="Each lab is one exercise of a notebook; `check` runs that notebook's checker on your file. "
        "Exit status: 0 the check passes, 1 it fails, 2 it could not run (no such lab, a file that is missing, "
        "does not import or lacks a name the lab needs).",
    )
    lab_sub = lab.add_subparsers(dest="lab_command", required=True)
    lab_sub.add_parser("list", parents=[common], help="every lab: its name, its notebook, what the file defines")
    start = lab_sub.add_parser(
        "start", parents=[common], help="write a starter file: the notebook's skeleton, with its exercise as docstring"
    )
    start.add_argument("name", help="the lab (pagedkv lab list)")
    start.add_argument("file", nargs="?", help="where to write it (default: the lab's name, as NAME.py)")
    start.add_argument("--force", action="store_true", help="replace FILE if it exists")
    check = lab_sub.add_parser(
        "check", parents=[common], help="grade FILE with the lab's checker: exit 0 if it passes, 1 if not"
    )
    check.add_argument("name", help="the lab (pagedkv lab list)")
    check.add_argument("file", help="the Python file that defines what the lab asks for")
    lab.set_defaults(func=_lab)
    add_serve_parser(sub, [common, plugins])
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        for plugin in getattr(args, "load", []):
            load_plugin(plugin)
        code = args.func(args)
    except KeyboardInterrupt:
        print("pagedkv: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (`pagedkv workbook --list | head`): stop quietly, as other tools do, and
        # point stdout at /dev/null so Python's flush at exit does not fail on the closed pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except Exception as error:
        if args.debug or os.environ.get("PAGEDKV_DEBUG") == "1":
            raise
        # Bad input (a value, a file, what this machine or model cannot do) exits 2 as argparse's usage
        # errors do; anything else is a failure (1), also one line: --debug shows where it came from.
        bad_input = isinstance(error, (ValueError, TypeError, NotImplementedError, OSError))
        message = " ".join(str(error).split()) or type(error).__name__
        if not bad_input:
            message = f"{type(error).__name__}: {message} (--debug or PAGEDKV_DEBUG=1 shows the traceback)"
        print(f"pagedkv: error: {message}", file=sys.stderr)
        sys.exit(2 if bad_input else 1)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
