"""Engine start-up, cold and warm, each in a fresh subprocess.

`measure(model, kwargs)` starts two processes one after the other, each building
`LLM(model, **kwargs)` and running one short request:

* cold: $PAGEDKV_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR point into a new empty
  temporary directory: every compilation happens;
* warm: the same directory again, now filled by the cold process: what a restart of a server
  with the same model and shapes costs.

Per process: `init_s` (the `LLM(...)` call: weights, KV cache, compilation, graph capture),
`first_request_s` (one 16-token prompt, 8 new tokens, right after) and `process_s` (from
spawning the process to its exit: the imports of torch and pagedkv included).

    python benchmarks/startup.py '{"model": "tiny", "kwargs": {"device": "cpu"}}'   # one start-up (what measure runs)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

MARK = "STARTUP "


def measure(model: str, kwargs: dict[str, object], timeout_s: float = 600) -> dict[str, dict[str, float]]:
    """Cold, then warm start-up of `LLM(model, **kwargs)`; each printed as it finishes."""
    cache = tempfile.mkdtemp(prefix="pagedkv-startup-")
    env = {
        **os.environ,
        "PAGEDKV_CACHE_DIR": cache,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
    }
    spec = json.dumps({"model": model, "kwargs": kwargs})
    out: dict[str, dict[str, float]] = {}
    try:
        for kind in ("cold", "warm"):
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, __file__, spec], env=env, capture_output=True, text=True, timeout=timeout_s
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
            if proc.returncode or not lines:
                sys.stderr.write(proc.stderr[-4000:])
                raise RuntimeError(
                    f"{kind} start-up process exited with {proc.returncode}: "
                    f"{(proc.stderr.strip().splitlines() or ['no output'])[-1][:200]}"
                )
            out[kind] = {**json.loads(lines[-1][len(MARK) :]), "process_s": time.perf_counter() - start}
            print(
                f"  start-up {kind:<4} {model} {kwargs}: LLM() {out[kind]['init_s']:.1f} s, first request "
                f"{out[kind]['first_request_s']:.2f} s, process {out[kind]['process_s']:.1f} s",
                flush=True,
            )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return out


def child(spec: dict[str, object]) -> None:
    """One start-up in this process; prints its times on a line starting with MARK."""
    start = time.perf_counter()
    from pagedkv import LLM, SamplingParams

    imports = time.perf_counter() - start
    start = time.perf_counter()
    llm = LLM(spec["model"], **spec["kwargs"])  # type: ignore[arg-type]
    init = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": list(range(3, 19))}],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    first = time.perf_counter() - start
    print(MARK + json.dumps({"import_s": imports, "init_s": init, "first_request_s": first}), flush=True)


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
