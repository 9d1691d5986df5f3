"""nano-vllm as W2's peer in the same run, on the pagedkv model's own random weights and KV cache bytes.

nano-vllm is never installed: `bash benchmarks/stage_peers.sh` copies ../shared/peers (nano-vllm's
package unchanged, a shim serving its two flash-attn 2 calls with flash-attn 4, and the launcher
that wires them) into the git-ignored `peers/` of this checkout, and xxhash's wheel into
`.whl/xxhash/`; a GPU call carries both (`run_side_by_side.sh` says how). `load()` imports it
from there (`$PAGEDKV_PEERS` names another folder) through the launcher's `install()`.

* `export(model, path)`: the model as a Hugging Face Qwen3 directory (`pagedkv.models.hf_export`,
  `save_pretrained`) with a word-level tokenizer of its vocabulary (nano-vllm loads one); nano-vllm
  serves `Qwen3ForCausalLM` only, so other models are skipped with the reason.
* `python benchmarks/nano_peer.py --into w2.json`: nano-vllm in a process of its own, after
  `end_to_end.py --nano-export DIR --json w2.json` has run the pagedkv rows, written the weights and
  exited (so no pagedkv memory is left on the GPU): for each W2 workload exported there, the same
  workload, warm-up workload and KV cache bytes, its row added to w2.json, the tables printed.
* `run(path, workload, warmup, kv_cache_bytes)`: nano-vllm's `LLM` with bench.py's settings and
  W2's batch limits, its KV cache exactly `kv_cache_bytes // block bytes` blocks (the pagedkv
  engine's bytes), then the same steps as a pagedkv row in `end_to_end.py`: one `generate` of the
  whole warm-up workload (its flash-attn 4 kernels JIT-compile at each new shape: cold, W2 read
  13,947 tok/s, warm 16,059, H100 2026-12-07), then the timed `generate` of the workload. The engine is shut down after
  (its process group too), so another nano-vllm can start in the same process.

There is no recorded figure here: every ratio to nano-vllm is to its run in the same process.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench  # noqa: E402  (beside this file; first: it puts the repository on sys.path for pagedkv)
import workloads  # noqa: E402
from workloads import Workload  # noqa: E402


def peers_dir() -> Path:
    """Where nano-vllm and its launcher were staged: $PAGEDKV_PEERS, else peers/ of this checkout."""
    return Path(os.environ.get("PAGEDKV_PEERS") or Path(__file__).resolve().parents[1] / "peers")


def unavailable() -> str | None:
    """Why nano-vllm cannot run here, or None."""
    where = peers_dir()
    if not (where / "nanovllm_launch.py").is_file():
        return f"no nano-vllm in {where} (bash benchmarks/stage_peers.sh, then carry peers/)"
    if not torch.cuda.is_available():
        return "nano-vllm needs a CUDA GPU"
    for module, hint in (
        ("flash_attn", "flash-attn 4: source .whl/fa4c/activate.sh"),
        ("xxhash", "its wheel from .whl/xxhash/ (stage_peers.sh)"),
        ("tqdm", "tqdm"),
    ):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not importable ({hint})"
    return None


def load() -> tuple[Any, Any]:
    """nano-vllm's (LLM, SamplingParams), flash-attn 4 under its flash-attn 2 imports."""
    where = str(peers_dir())
    if where not in sys.path:
        sys.path.insert(0, where)
    import nanovllm_launch

    return nanovllm_launch.install()


def export(model: torch.nn.Module, path: Path) -> str | None:
    """Write `model` as a Hugging Face Qwen3 directory nano-vllm can load; the reason when it cannot."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from pagedkv.models.hf_export import to_transformers

    weight = model.lm_head.weight
    hf = to_transformers(model, dtype=weight.dtype, device=weight.device, attn_implementation="sdpa")
    if type(hf).__name__ != "Qwen3ForCausalLM":
        return f"nano-vllm serves Qwen3 only; this model exports as {type(hf).__name__}"
    hf.save_pretrained(path)
    vocab = {str(i): i for i in range(model.config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="0")), eos_token=str(model.config.eos_token_id[0])
    )
    tokenizer.save_pretrained(path)
    return None


def utilization_for(blocks: int, block_bytes: int, used: int, peak: int, current: int, total: int) -> float:
    """The `gpu_memory_utilization` for which nano-vllm's sizing, `int(total * u - used - peak + current)
    // block_bytes`, gives `blocks` (half a block over, so that rounding cannot land one short)."""
    return (blocks * block_bytes + block_bytes / 2 + used + peak - current) / total


@contextmanager
def kv_cache_of(kv_cache_bytes: int, sized: dict[str, int]) -> Iterator[None]:
    """nano-vllm's KV cache made `kv_cache_bytes // block bytes` blocks (into `sized`), not what its
    `gpu_memory_utilization` leaves.

    Its `ModelRunner.allocate_kv_cache` takes `int(total * utilization - used - peak + current) //
    block_bytes` blocks; the wrapper reads the same four figures right before it (nothing allocates
    in between) and sets the utilization that gives the wanted count, half a block over so the floor
    lands on it. Its package stays unchanged; the class gets its method back on exit.
    """
    from nanovllm.engine import model_runner

    runner_cls = model_runner.ModelRunner
    original = runner_cls.allocate_kv_cache

    def allocate_kv_cache(self: Any) -> None:
        config, hf = self.config, self.config.hf_config
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        used, peak, current = total - free, stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv_heads = hf.num_key_value_heads // self.world_size
        block_bytes = 2 * hf.num_hidden_layers * self.block_size * kv_heads * head_dim * hf.dtype.itemsize
        blocks = kv_cache_bytes // block_bytes
        config.gpu_memory_utilization = utilization_for(blocks, block_bytes, used, peak, current, total)
        original(self)
        if config.num_kvcache_blocks != blocks:
            raise RuntimeError(f"nano-vllm took {config.num_kvcache_blocks} KV blocks, not {blocks}")
        sized.update(num_kvcache_blocks=blocks, block_bytes=block_bytes, kv_cache_bytes=blocks * block_bytes)

    runner_cls.allocate_kv_cache = allocate_kv_cache
    try:
        yield
    finally:
        runner_cls.allocate_kv_cache = original


def run(path: Path, workload: Workload, warmup: Workload, kv_cache_bytes: int) -> dict[str, object]:
    """nano-vllm on `warmup`, then timed on `workload` (W2's engine limits: 512 sequences, 16,384 tokens a step)."""
    nano_llm, nano_params = load()

    def params(w: Workload) -> list[Any]:
        return [nano_params(temperature=p.temperature, ignore_eos=True, max_tokens=p.max_tokens) for p in w.params]

    sized: dict[str, int] = {}
    start = time.perf_counter()
    with kv_cache_of(kv_cache_bytes, sized):
        llm = nano_llm(
            str(path),
            enforce_eager=False,
            max_model_len=4096,
            max_num_seqs=workload.engine["max_num_seqs"],
            max_num_batched_tokens=workload.engine["max_num_batched_tokens"],
        )
    init_s = time.perf_counter() - start
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(warmup.prompts, params(warmup), use_tqdm=False)
        torch.cuda.synchronize()
        warmup_s = time.perf_counter() - start
        timed = params(workload)
        start = time.perf_counter()
        outs = llm.generate(workload.prompts, timed, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        llm.exit()  # its CUDA graphs and process group go now, not at interpreter exit
        atexit.unregister(llm.exit)
    tokens = sum(len(o["token_ids"]) for o in outs)
    return {
        "init_s": init_s,
        "warmup_s": warmup_s,
        "warmup_output_tokens": warmup.output_tokens,
        "generate": {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds},
        **sized,
    }


MODE = "its defaults (CUDA graphs), flash-attn 4 through the peers' shim"


def add_rows(result: dict[str, Any], save: Any) -> None:
    """nano-vllm's row in every W2 workload of an `end_to_end.py --nano-export` result (`save()` after each)."""
    from pagedkv.models.loader import load_config

    args = result["args"]
    for record in result["workloads"]:
        export = record.get("nano_export")
        if record["name"] != "W2" or not export:
            continue
        row: dict[str, Any] = {"engine": "nano-vllm", "mode": MODE, "process": "its own, after pagedkv's exited"}
        reason = export.get("error") or unavailable()
        if reason:
            row["skipped"] = reason
        else:
            kv_bytes = int(record["engine_args"]["kv_cache_memory"])
            workload = workloads.w2(
                record["model"],
                load_config(record["model"]).vocab_size,
                kv_bytes,
                record["num_requests"],
                args.get("max_tokens"),
            )
            warmup = workload.resampled(1, args.get("warmup_max_tokens"))
            try:
                row.update(run(Path(export["dir"]), workload, warmup, kv_bytes))
            except Exception as exc:  # the table says why (traceback on stderr)
                row["error"] = engine_bench.error_text(exc)
        record["rows"] = [r for r in record["rows"] if r["engine"] != "nano-vllm"] + [row]
        print(json.dumps(row, default=str), flush=True)
        save()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--into", type=Path, required=True, help="the JSON of an end_to_end.py --nano-export run")
    args = p.parse_args()
    result = json.loads(args.into.read_text())
    if not any(w.get("nano_export") for w in result["workloads"]):
        sys.exit(f"{args.into}: no W2 workload was exported for nano-vllm (end_to_end.py --nano-export DIR)")

    def save() -> None:
        args.into.write_text(json.dumps(result, indent=1, default=str))

    add_rows(result, save)
    import readme_figures  # beside this file

    print()
    print(readme_figures.render(result, markdown=False))


if __name__ == "__main__":
    main()
