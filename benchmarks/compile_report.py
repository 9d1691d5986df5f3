"""What the compiler makes of the attention kernel, without a GPU: registers, spills, shared memory, copies.

    python benchmarks/compile_report.py                       # decode over bf16 and fp8 caches, default tiles
    python benchmarks/compile_report.py fp8:128:4:2 fp8:64:4:2:128 --json report.json
    python benchmarks/compile_report.py prefill:128:128:8:3 prefill-tma:128:128:8:3

A decode CONFIG is `cache:keys:warps:stages[:register cap]` (cache bf16 or fp8) for TRITON_ATTN's
decode of llama3-8b's attention (32 query / 8 KV heads, head 128, block size 16, split-KV on); a
prefill CONFIG is `prefill:rows:keys:warps:stages` (bf16, pages of 16: K/V gathered with pointer
copies) or `prefill-tma:...` (pages of 128: q, K and V tiles by tensor descriptors). Triton
compiles it for sm_90 (Hopper) on this machine, its own ptxas counts the registers, and the PTX is
searched for the instructions that decide the kernel's speed:

    registers, programs/SM   more than 128 registers per thread leave fewer than 4 programs of 4
                             warps on an SM (65,536 registers), so fewer loads are in flight
    copies 16 B / < 16 B     cp.async global -> shared memory; 16 bytes per copy is the widest
    ldmatrix / ld.shared.b8  a dot operand loaded from shared memory 8 x 8 at a time, or byte by byte
    wgmma / tma              Hopper's warpgroup tensor-core instructions; TMA (bulk tensor) copies

A report, not a timing: the H200 decides (`benchmarks/attention.py --sweep fp8-decode`). It found that
an fp8 V tile cast directly was gathered byte by byte (see `_widen_fp8_tile`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiling needs Triton's real JIT, whatever the shell set

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pagedkv.kernels.attention_config import Tuning  # noqa: E402
from pagedkv.kernels.unified_attention import _unified_attention_kernel as kernel  # noqa: E402


def default_configs() -> list[str]:
    """The decode tiles choose_config picks: Tuning.decode (bf16 cache), Tuning.fp8_decode."""
    tuning = Tuning()
    out = []
    for cache, t in (("bf16", tuning.decode), ("fp8", tuning.fp8_decode)):
        cap = "" if t.max_registers is None else f":{t.max_registers}"
        out.append(f"{cache}:{t.block_n}:{t.num_warps}:{t.num_stages}{cap}")
    return out


POINTERS = {
    "q_ptr": "*bf16",
    "out_ptr": "*bf16",
    "lse_ptr": "*fp32",
    "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "block_table_ptr": "*i32",
    "k_scale_ptr": "*fp32",
    "v_scale_ptr": "*fp32",
}
UNIT_STRIDES = ("stride_q_d", "stride_o_d", "stride_kc_d", "stride_vc_d")
"""Innermost strides: 1, which Triton turns into constants at launch."""
PER_STEP = ("num_reqs", "num_splits", "num_q_tiles")
"""Integers the kernel does not specialise; every other int is a multiple of 16 at launch."""


def compile_attention(
    cache: str, keys: int, warps: int, stages: int, max_registers: int | None, prefill_rows: int = 0, tma: bool = False
) -> tuple[str, int]:
    """The PTX of one configuration (a decode's, or with `prefill_rows` a prefill's), and its shared
    memory in bytes."""
    fp8 = cache == "fp8"
    rows = prefill_rows or 16
    constants: dict[str, object] = dict(
        G=4,
        HEAD_SIZE=128,
        HEAD_PAD=128,
        HEAD_SIZE_V=128,
        HEAD_PAD_V=128,
        BLOCK_M=rows,
        BLOCK_Q=rows // 4,
        BLOCK_N=keys,
        PAGE_SIZE=128 if tma else 16,
        SPLIT_KV=not prefill_rows,
        ONE_TILE_PER_REQ=not prefill_rows,
        USE_WINDOW=False,
        NUM_KV_HEADS=8,
        SHORT_Q=0,
        TMA=tma,
        DOT_PRECISION="tf32",
        UPCAST=False,
        FP8=fp8,
        FP8_DOTS_F16=fp8,
        **dict.fromkeys(UNIT_STRIDES, 1),
    )
    cache_type = "*fp8e4nv" if fp8 else "*bf16"
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = POINTERS.get(name) or (cache_type if name in ("k_cache_ptr", "v_cache_ptr") else "i32")
        if tma and name == "q_ptr":  # descriptors: q as [tokens, heads, head], the caches as [slots, heads x head]
            signature[name] = f"tensordesc<bf16[{rows // 4},4,128]>"
        elif tma and name in ("k_cache_ptr", "v_cache_ptr"):
            signature[name] = f"tensordesc<bf16[{keys},128]>"
        elif name == "qk_scale":
            signature[name] = "fp32"
        elif name not in PER_STEP:  # pointers and strides: aligned to 16 (bytes or elements)
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()},
        attrs=attrs,
    )
    options: dict[str, object] = {"num_warps": warps, "num_stages": stages}
    if max_registers is not None:
        options["maxnreg"] = max_registers
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"], compiled.metadata.shared


def registers(ptx: str) -> tuple[int, int]:
    """Registers per thread and spilled bytes, from Triton's own ptxas (the one it ships)."""
    ptxas = get_ptxas(90).path  # the ptxas Triton itself would run for sm_90 (its version differs by release)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        info = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    spill = re.search(r"(\d+) bytes spill stores", info)
    return int(re.findall(r"Used (\d+) registers", info)[0]), int(spill.group(1)) if spill else 0


def report(config: str) -> dict[str, object]:
    parts = config.split(":")
    numbers = len(parts) in (4, 5) and all(p.isdigit() for p in parts[1:])
    if parts[0] in ("prefill", "prefill-tma") and numbers and len(parts) == 5:
        _, rows, keys, warps, stages = parts
        ptx, smem = compile_attention(
            "bf16", int(keys), int(warps), int(stages), None, int(rows), parts[0] != "prefill"
        )
    elif parts[0] in ("bf16", "fp8") and numbers:
        cache, keys, warps, stages, *cap = parts
        ptx, smem = compile_attention(cache, int(keys), int(warps), int(stages), int(cap[0]) if cap else None)
    else:
        raise SystemExit(
            f"compile_report: error: {config!r} is neither cache:keys:warps:stages[:register cap] (e.g. fp8:64:4:2:128) "
            "nor prefill[-tma]:rows:keys:warps:stages (e.g. prefill:128:128:8:3)"
        )
    regs, spill = registers(ptx)
    threads = 32 * int(warps)
    return {
        "config": config,
        "registers": regs,
        "spill_bytes": spill,
        "shared_bytes": smem,
        "programs_per_sm": min(65536 // (regs * threads), 228 * 1024 // max(smem, 1), 2048 // threads),
        "copies_16B": len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)),
        "copies_under_16B": len(re.findall(r"cp\.async\.ca\.shared\.global", ptx)),
        "ldmatrix": len(re.findall(r"ldmatrix", ptx)),
        "shared_byte_loads": len(re.findall(r"ld\.shared\.[bsu]8", ptx)),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "tma_copies": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", metavar="CONFIG", help="default: the decode tiles of Tuning()")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = [report(config) for config in args.configs or default_configs()]
    print(f"triton {triton.__version__}, sm_90 (counts are of PTX instructions in the code, not executed)")
    keys = list(rows[0])
    print("  ".join(f"{k:>17}" for k in keys))
    for row in rows:
        print("  ".join(f"{row[k]!s:>17}" for k in keys))
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
