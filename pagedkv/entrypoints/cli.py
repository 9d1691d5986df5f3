"""`pagedkv serve MODEL [engine options] [--host --port --served-model-name]` (as vllm/entrypoints/cli/serve.py).

Only the parser lives here with no third-party import: the server's packages (the `serve` extra)
are imported when the command runs, so the rest of the CLI works without them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedkv.checks import check_int
from pagedkv.engine.arg_utils import CLI_ARGS, EngineArgs, add_cli_args

SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "jinja2")
"""What `pagedkv serve` needs (pyproject.toml's `serve` extra; each module is named as its package)."""


def add_serve_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """Register `serve` among the sub-commands of `python -m pagedkv` (`parents`: the options every
    engine-building sub-command shares, --debug and --load)."""
    serve = sub.add_parser(
        "serve",
        parents=parents,
        help="serve MODEL over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, /metrics)",
        description="An OpenAI-compatible server (pip install 'pagedkv[serve]'): point the openai client at "
        "http://HOST:PORT/v1. The engine options are LLM's arguments (pagedkv.engine.arg_utils.EngineArgs).",
    )
    serve.add_argument("model", help="a preset (e.g. tiny-pydoc) or a Hugging Face model directory")
    add_cli_args(serve, [name for name in CLI_ARGS if name != "model"])
    serve.add_argument(
        "--seed", type=int, default=EngineArgs.seed, help="the engine's seed, from which unseeded requests draw"
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    serve.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: MODEL as given)"
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default %(default)s; info logs every request)",
    )
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> None:
    missing = []
    for module in SERVE_PACKAGES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        sys.exit(
            f"pagedkv: error: pagedkv serve needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            "not installed: pip install 'pagedkv[serve]'"
        )
    port = check_int("--port", args.port, 1, 65535)
    from pagedkv.entrypoints.openai.api_server import run_server

    engine_args = {name: getattr(args, name) for name in [*CLI_ARGS, "seed"] if name != "model"}
    run_server(
        args.model,
        engine_args,
        host=args.host,
        port=port,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
    )
