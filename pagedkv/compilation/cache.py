"""The on-disk compile cache: a second engine with the same model and shapes starts warm.

    $PAGEDKV_CACHE_DIR (default ~/.cache/pagedkv/compile)
      inductor/   TORCHINDUCTOR_CACHE_DIR: Inductor's FX graph cache and AOTAutograd's cache
                  (a compiled piece, looked up by a hash of its graph, inputs and configs)
      triton/     TRITON_CACHE_DIR: compiled Triton kernels (Inductor's and pagedkv's own)

A directory the user set (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) is left as it is. Inductor's
own default sits under /tmp, which many machines wipe; vLLM keeps its compile cache in the
user's cache directory too (vllm/compilation/compiler_interface.py, vllm/envs.py VLLM_CACHE_ROOT).

What a warm start saves is Inductor's work (code generation, C++ / Triton builds, autotuning).
Dynamo still traces the forward in every new process: torch's way to skip that (the "AOT
precompile", `torch.compiler.load_compiled_function`) is marked experimental and serialises
only Inductor's own outputs, not the graph a custom backend such as `PiecewiseBackend` returns.
`torch.compiler.save_cache_artifacts` / `load_cache_artifacts` ("mega cache") move these same
caches to another machine as bytes; on one machine the directories below already do that.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR_ENV = "PAGEDKV_CACHE_DIR"
"""Where pagedkv keeps its compile cache; default ~/.cache/pagedkv/compile."""


def compile_cache_dir() -> Path:
    """$PAGEDKV_CACHE_DIR, else ~/.cache/pagedkv/compile (under $XDG_CACHE_HOME when set)."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedkv" / "compile"


def enable_compile_cache() -> Path:
    """Turn on Inductor's FX graph cache and AOTAutograd's cache, with their files (and Triton's)
    under `compile_cache_dir()` unless the user chose directories; returns Inductor's directory.

    Called before the first compile of a process (`compile_model`). Both caches are on by default
    in recent torch; they are turned on here because the warm start depends on them. The
    variables TORCHINDUCTOR_FX_GRAPH_CACHE / TORCHINDUCTOR_AUTOGRAD_CACHE=0 still turn them off
    (torch's config reads them over any value set in code).
    """
    import torch._functorch.config
    import torch._inductor.config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    root = compile_cache_dir()
    inductor_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # Importing Inductor writes its /tmp default into the environment, so only another value
    # is the user's choice.
    if inductor_dir is None or os.path.abspath(inductor_dir) == os.path.abspath(default_cache_dir()):
        inductor_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return Path(inductor_dir)


@dataclass
class CacheReport:
    """How the compiled pieces of one trace were found: Inductor's counters, read around it."""

    hits: int = 0
    """Pieces loaded from the cache (AOTAutograd's or, under it, Inductor's FX graph cache)."""
    misses: int = 0
    """Pieces compiled, then written to the cache."""
    bypasses: int = 0
    """Pieces the cache refused to store (something in the graph cannot be hashed)."""
    directory: Path | None = None
    """Inductor's cache directory."""

    @property
    def state(self) -> str:
        """ "warm" (every piece from the cache), "cold" (none), "partly warm", or "unused" (nothing
        went through Inductor: the eager piece compiler)."""
        if self.hits and not (self.misses or self.bypasses):
            return "warm"
        if self.hits:
            return "partly warm"
        return "cold" if self.misses or self.bypasses else "unused"

    def describe(self) -> str:
        """One phrase for the start-up log."""
        if self.state == "unused":
            return "compile cache unused (no piece went through Inductor)"
        counts = f"{self.hits} piece(s) loaded, {self.misses} compiled"
        if self.bypasses:
            counts += f", {self.bypasses} not cacheable"
        return f"compile cache {self.state} ({counts}; {self.directory})"


_COUNTERS = {
    "aot_hit": ("aot_autograd", "autograd_cache_hit"),
    "fx_hit": ("inductor", "fxgraph_cache_hit"),
    "fx_miss": ("inductor", "fxgraph_cache_miss"),
    "fx_bypass": ("inductor", "fxgraph_cache_bypass"),
}


@contextmanager
def cache_report(directory: Path | None) -> Iterator[CacheReport]:
    """Count how the compiles run inside the block used the caches (torch's counters, before and after).

    A piece is looked up in AOTAutograd's cache first; a hit there loads Inductor's code (which
    the FX graph cache may count as its hit too), a miss falls through to the FX graph cache. So
    a piece compiled anew shows as an FX graph miss (or bypass: not cacheable), and a loaded one
    as a hit of either cache, counted once by taking the larger count.
    """
    from torch._dynamo.utils import counters

    def read() -> dict[str, int]:
        return {name: counters[group][key] for name, (group, key) in _COUNTERS.items()}

    report = CacheReport(directory=directory)
    before = read()
    try:
        yield report
    finally:
        delta = {name: value - before[name] for name, value in read().items()}
        report.hits = max(delta["aot_hit"], delta["fx_hit"])
        report.misses, report.bypasses = delta["fx_miss"], delta["fx_bypass"]
