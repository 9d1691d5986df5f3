"""benchmarks/nano_peer.py and readme_figures.py on the CPU: nano-vllm's KV cache sizing, the reason it is
skipped without its staged copy, and ratios only to a peer of the same run."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[tuple]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import nano_peer
        import readme_figures

        yield nano_peer, readme_figures
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_utilization_gives_nano_vllm_exactly_the_blocks_asked(bench: tuple) -> None:
    """nano-vllm's own formula (model_runner.allocate_kv_cache), fed the utilization, yields the count."""
    nano_peer, _ = bench
    rng = random.Random(0)
    for _ in range(2000):
        total = rng.choice([80, 141]) * 10**9 + rng.randrange(10**9)
        current = rng.randrange(1, 20 * 10**9)
        peak = current + rng.randrange(10 * 10**9)
        used = current + rng.randrange(2 * 10**9)
        block_bytes = 2 * rng.choice([28, 36]) * 256 * 8 * 128 * 2
        blocks = rng.randrange(1, 40 * 10**9 // block_bytes)
        u = nano_peer.utilization_for(blocks, block_bytes, used, peak, current, total)
        assert int(total * u - used - peak + current) // block_bytes == blocks


def test_unstaged_peer_says_how_to_stage_it(bench: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nano_peer, _ = bench
    monkeypatch.setenv("PAGEDKV_PEERS", str(tmp_path))
    assert "stage_peers.sh" in nano_peer.unavailable()


def test_ratios_divide_only_by_the_same_runs_nano_vllm(bench: tuple) -> None:
    _, readme_figures = bench
    workload = {
        "name": "W2",
        "model": "qwen3-0.6b",
        "num_requests": 256,
        "prompt_tokens": 1,
        "output_tokens": 1,
        "temperature": 0.6,
        "engine_args": {"max_num_seqs": 512},
        "roofline": None,
        "rows": [
            {
                "engine": "pagedkv",
                "mode": "default",
                "generate": {"seconds": 1.0, "output_tokens_per_s": 15000.0},
                "stream": {"output_tokens_per_s": 12000.0},
                "kernels": {"gpu_s": 0.8, "wall_s": 1.3},
            },
            {
                "engine": "nano-vllm",
                "mode": "its defaults",
                "generate": {"seconds": 1.0, "output_tokens_per_s": 10000.0},
            },
        ],
    }
    _, columns, cells = readme_figures.workload_table(workload)
    assert not any("recorded" in c for c in columns)
    ratios = dict(zip(columns, cells[0], strict=True))
    assert ratios["generate x nano-vllm (this run)"] == "1.50"
    assert ratios["stream x nano-vllm (this run)"] == "1.20"
    assert ratios["generate wall / GPU-busy s"] == "1.00 / 0.80 (+25%)"  # the unprofiled run's wall
    workload["rows"] = workload["rows"][:1]  # no peer in this run: no ratio at all
    _, columns, cells = readme_figures.workload_table(workload)
    assert all(not v for c, v in zip(columns, cells[0], strict=True) if "nano" in c)


FAKE_LAUNCH = """
import nanovllm


def install():
    return nanovllm.LLM, nanovllm.SamplingParams
"""

FAKE_PACKAGE = """
import atexit
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from nanovllm.engine.model_runner import ModelRunner

EVENTS = []


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False


@dataclass
class Config:
    model: str
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    num_kvcache_blocks: int = -1
    hf_config: object = field(default_factory=lambda: SimpleNamespace(
        num_hidden_layers=28, num_key_value_heads=8, head_dim=128, hidden_size=1024, num_attention_heads=16,
        dtype=torch.bfloat16))


class LLM:
    def __init__(self, model, **kwargs):
        self.config = Config(model, **kwargs)
        self.model_runner = ModelRunner(self.config)
        atexit.register(self.exit)

    def generate(self, prompts, params, use_tqdm=True):
        EVENTS.append(("generate", len(prompts)))
        return [{"text": "", "token_ids": [7] * p.max_tokens} for p in params]

    def exit(self):
        EVENTS.append(("exit",))
"""

FAKE_RUNNER = '''
import torch


class ModelRunner:
    """Sizes its KV cache as nano-vllm's does: what the utilization leaves beside the memory in use."""

    def __init__(self, config):
        self.config, self.block_size, self.world_size = config, 256, 1
        self.allocate_kv_cache()

    def allocate_kv_cache(self):
        hf = self.config.hf_config
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        spare = total * self.config.gpu_memory_utilization - (total - free) - stats["allocated_bytes.all.peak"]
        block = 2 * hf.num_hidden_layers * self.block_size * hf.num_key_value_heads * hf.head_dim * hf.dtype.itemsize
        self.config.num_kvcache_blocks = int(spare + stats["allocated_bytes.all.current"]) // block
'''


def test_run_sizes_the_cache_warms_up_then_times_and_shuts_the_engine(
    bench: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run` against a stand-in nano-vllm (same entry points, CUDA memory figures faked): its KV cache is the
    bytes asked (not its utilization's), the warm-up workload runs whole before the timed one, and the engine
    is shut down after (and no longer at interpreter exit)."""
    import atexit

    import torch

    import workloads

    nano_peer, _ = bench
    peers = tmp_path / "peers"
    (peers / "nanovllm" / "engine").mkdir(parents=True)
    (peers / "nanovllm_launch.py").write_text(FAKE_LAUNCH)
    (peers / "nanovllm" / "__init__.py").write_text(FAKE_PACKAGE)
    (peers / "nanovllm" / "engine" / "__init__.py").write_text("")
    (peers / "nanovllm" / "engine" / "model_runner.py").write_text(FAKE_RUNNER)
    monkeypatch.setenv("PAGEDKV_PEERS", str(peers))
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70 * gib, 80 * gib))
    stats = {"allocated_bytes.all.peak": 5 * gib, "allocated_bytes.all.current": 2 * gib}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: stats)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    unregistered = []
    monkeypatch.setattr(atexit, "unregister", unregistered.append)
    try:
        w2 = workloads.w2("tiny", 320, 48 * gib, num_requests=3, max_tokens=5)
        warm = w2.resampled(1, 2)
        out = nano_peer.run(tmp_path, w2, warm, 48 * gib)
        import nanovllm

        block = 2 * 28 * 256 * 8 * 128 * 2
        assert out["num_kvcache_blocks"] == 48 * gib // block
        assert out["kv_cache_bytes"] == 48 * gib // block * block
        assert nanovllm.EVENTS == [("generate", 3), ("generate", 3), ("exit",)]
        assert out["generate"]["output_tokens"] == w2.output_tokens
        assert out["warmup_output_tokens"] == warm.output_tokens
        assert len(unregistered) == 1
        assert nanovllm.engine.model_runner.ModelRunner.allocate_kv_cache.__name__ == "allocate_kv_cache"
        assert "nano_peer" not in nanovllm.engine.model_runner.ModelRunner.allocate_kv_cache.__qualname__
    finally:
        for name in [m for m in sys.modules if m == "nanovllm" or m.startswith("nanovllm.")] + ["nanovllm_launch"]:
            sys.modules.pop(name, None)
        if str(peers) in sys.path:
            sys.path.remove(str(peers))
