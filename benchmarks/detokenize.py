"""Host time of the output text per engine step: whole decode vs `IncrementalDetokenizer`.

    python benchmarks/detokenize.py [--requests 128] [--lengths 128 512] [--json out.json]

After each step the engine returns the text of every request that got a token. Decoding each
request's whole output costs O(length) per step; the incremental detokenizer decodes a window of
the newest tokens. Both run here over the same token streams, one token per request per step, as
the engine calls them: real text (Python's pydoc topics) encoded by the presets' ByteTokenizer
and by tiny-pydoc's Hugging Face tokenizer (when transformers is installed). CPU only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from pagedkv.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer  # noqa: E402

TINY_PYDOC = Path(__file__).resolve().parents[1] / "pagedkv" / "models" / "data" / "tiny-pydoc"


def token_streams(tokenizer: Tokenizer, requests: int, length: int, seed: int = 0) -> list[list[int]]:
    """`requests` stretches of `length` tokens of encoded pydoc text (random starting points)."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n".join(topics.values())[:400_000])
    rng = random.Random(seed)
    starts = [rng.randrange(len(ids) - length) for _ in range(requests)]
    return [ids[s : s + length] for s in starts]


def ms_per_step(streams: list[list[int]], make: Callable[[], Callable[[list[int]], str]]) -> float:
    """Host time of one step's texts (every request one token longer), averaged over the steps."""
    texts = [make() for _ in streams]
    length = len(streams[0])
    start = time.perf_counter()
    for step in range(1, length + 1):
        for text, ids in zip(texts, streams):
            text(ids[:step])
    return (time.perf_counter() - start) / length * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tokenizers: dict[str, Tokenizer] = {"ByteTokenizer (presets)": ByteTokenizer()}
    try:
        tokenizers["Hugging Face (tiny-pydoc's tokenizer.json)"] = HFTokenizer(str(TINY_PYDOC))
    except ImportError:
        print("transformers is not installed: the Hugging Face tokenizer is skipped")
    rows = []
    for name, tokenizer in tokenizers.items():
        for length in args.lengths:
            streams = token_streams(tokenizer, args.requests, length)
            whole = ms_per_step(streams, lambda t=tokenizer: t.decode)
            incremental = ms_per_step(streams, lambda t=tokenizer: IncrementalDetokenizer(t).text)
            rows.append(
                {
                    "tokenizer": name,
                    "requests": args.requests,
                    "length": length,
                    "whole_decode_ms_per_step": whole,
                    "incremental_ms_per_step": incremental,
                }
            )
    print(f"{'tokenizer':<44}{'requests x tokens':>18}{'whole ms/step':>15}{'incremental':>13}{'speed-up':>10}")
    for r in rows:
        shape = f"{r['requests']} x {r['length']}"
        print(
            f"{r['tokenizer']:<44}{shape:>18}{r['whole_decode_ms_per_step']:15.2f}"
            f"{r['incremental_ms_per_step']:13.2f}{r['whole_decode_ms_per_step'] / r['incremental_ms_per_step']:9.1f}x"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
