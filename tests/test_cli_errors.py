"""Every error a user can cause is one line `pagedkv: error: ...` from `python -m pagedkv` (exit 2
for bad input, 1 for any other failure; --debug or PAGEDKV_DEBUG=1 shows the traceback), and the
files a model is read from are named when they are wrong."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pagedkv.__main__ as cli_module
from pagedkv import LLM
from pagedkv.__main__ import main as cli
from pagedkv.models.loader import PRESETS, TRAINED_PRESETS, load_config, weight_bytes
from pagedkv.trace.step_trace import StepTrace
from tests.conftest import edit_config_json, write_hf_llama

safetensors_torch = pytest.importorskip("safetensors.torch")

GENERATE = ["generate", "--device", "cpu", "--prompt-token-ids", "1,2,3", "--max-tokens", "1"]


def error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    """(exit code, the one line on stderr) of the CLI; fails unless stderr holds exactly one line."""
    with pytest.raises(SystemExit) as exited:
        cli(argv)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return exited.value.code, lines[0]


def kv_cache_gib(num_blocks: int, block_size: int, model: str) -> str:
    """The KV cache's size from the preset's shapes: K and V per token, layer and KV head."""
    cfg = PRESETS[model]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    nbytes = num_blocks * block_size * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
    return f"{nbytes / 2**30:.2f} GiB"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Before, both listed backends as "ok".
        (["backends", "--block-size", "0"], r"--block-size must be an int >= 1 \(tokens per KV cache block\), got 0\."),
        (
            ["backends", "--kv-cache-dtype", "fp9"],
            r"Unknown kv_cache_dtype 'fp9'; use 'auto', one of \['fp8', 'fp8_e4m3'\]",
        ),
        pytest.param(
            ["backends", "--device", "cuda"],
            r"device='cuda' was asked for, but no CUDA device is visible",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible"),
        ),
        # Before: accepted as the CPU.
        (
            [*GENERATE[:1], "--device", "cpu:1", *GENERATE[3:]],
            r"device='cpu:1': there is one CPU device; use "
            r'device="cpu"\.',
        ),
        # Before: NotImplementedError tracebacks.
        (
            [*GENERATE, "--model", "tiny-mla", "--tensor-parallel-size", "2"],
            r"tensor_parallel_size=2: DeepseekV2ForCausalLM models run on one rank only here",
        ),
        (
            [*GENERATE, "--cudagraph-mode", "PIECEWISE", "--tensor-parallel-size", "2"],
            r"tensor_parallel_size=2 captures whole-model CUDA graphs only .*got cudagraph_mode=PIECEWISE",
        ),
        # `pagedkv lab`: the labs are listed (tests/exercises/test_labs.py has the rest).
        (["lab", "check", "qkv-widht", "mine.py"], r"no lab 'qkv-widht'; the labs are: choose-backend, qkv-width, "),
        (
            ["lab", "start", "qkv-width", "no/such/dir/mine.py"],
            r"\[Errno 2\] No such file or directory: 'no/such/dir/mine.py'",
        ),
        # Before: the CPU allocator's message under a traceback (it tried 1,525,878 GiB).
        (
            [*GENERATE, "--num-kv-blocks", "100000000000"],
            r"The KV cache \(100000000000 blocks of 16 tokens for 4 layers\) needs "
            + re.escape(kv_cache_gib(100000000000, 16, "tiny"))
            + r" on cpu, but only .* GiB is available: it was sized "
            r"by num_kv_blocks=100000000000",
        ),
    ],
)
def test_user_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, line = error_line(capsys, argv)
    assert code == 2
    assert re.fullmatch(r"pagedkv: error: " + message + ".*", line), line


def test_python_m_pagedkv_is_one_line_and_exit_2() -> None:
    """The real entry point, in a process of its own (the other tests call main() in-process)."""
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_DEBUG"}
    done = subprocess.run(
        [sys.executable, "-m", "pagedkv", "backends", "--block-size", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (done.returncode, done.stderr.splitlines()) == (
        2,
        ["pagedkv: error: --block-size must be an int >= 1 (tokens per KV cache block), got 0."],
    )


def test_weights_that_do_not_fit_are_refused_before_allocating(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V2-Lite has 15.7B parameters (its model card): 58.5 GiB in float32, more than the
    16 GiB this machine is made to have. Before, the engine allocated them (48 lines of traceback,
    or the kernel's OOM killer on a machine that overcommits)."""
    monkeypatch.setattr("pagedkv.worker.memory.available_memory", lambda device: 16 * 2**30)
    code, line = error_line(capsys, [*GENERATE, "--model", "deepseek-v2-lite"])
    assert code == 2
    assert re.fullmatch(
        r"pagedkv: error: Model 'deepseek-v2-lite' \(15\.7\dB parameters, float32 while loading\) "
        r"needs 58\.\d\d GiB on cpu, but only 16\.00 GiB is available: use a smaller model, or a GPU\.",
        line,
    ), line


@pytest.mark.parametrize("model", ["tiny", "tiny-mla"])
def test_weight_bytes_counts_what_is_built(model: str) -> None:
    """The meta-device count equals the float32 model the engine builds (before any cast)."""
    built = LLM(model, device="cpu", dtype="float32", num_kv_blocks=16).model
    tensors = [*built.parameters(), *built.buffers()]
    assert weight_bytes(PRESETS[model]) == (
        sum(t.numel() * 4 for t in tensors),
        sum(p.numel() for p in built.parameters()),
    )


def test_keyboard_interrupt_is_one_short_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "_generate", interrupted)
    assert error_line(capsys, GENERATE) == (130, "pagedkv: interrupted")


def test_other_failures_are_one_line_exit_1_and_debug_shows_the_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(args: object) -> None:
        raise RuntimeError("the engine broke\nsomewhere")

    monkeypatch.setattr(cli_module, "_generate", broken)
    assert error_line(capsys, GENERATE) == (
        1,
        "pagedkv: error: RuntimeError: the engine broke somewhere (--debug or PAGEDKV_DEBUG=1 shows the traceback)",
    )
    with pytest.raises(RuntimeError, match="the engine broke"):
        cli([*GENERATE, "--debug"])
    with pytest.raises(RuntimeError, match="the engine broke"):
        cli(["--debug", *GENERATE])
    monkeypatch.setenv("PAGEDKV_DEBUG", "1")
    with pytest.raises(RuntimeError, match="the engine broke"):
        cli(GENERATE)


# ---- the files of a model directory: each error names the file ---------------------------------


@pytest.fixture
def pydoc_dir(tmp_path: Path) -> Path:
    """A copy of the trained preset's directory: weights, config, tokenizer and generation config."""
    return Path(shutil.copytree(TRAINED_PRESETS["tiny-pydoc"], tmp_path / "pydoc"))


def test_truncated_safetensors_names_the_file(capsys: pytest.CaptureFixture[str], pydoc_dir: Path) -> None:
    weights = pydoc_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    code, line = error_line(capsys, [*GENERATE, "--model", str(pydoc_dir)])
    assert code == 2
    assert line.startswith(f"pagedkv: error: {weights} is not a readable safetensors file ("), line


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_weights_that_are_not_floating_point_are_refused(tmp_path: Path, dtype: torch.dtype) -> None:
    """Before, they were loaded: copied into the float parameters as 0/1 or whole numbers."""
    model_dir = write_hf_llama(tmp_path / "model")
    path = model_dir / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: tensor 'model.norm.weight' is {dtype}; weights must be floating point")
    ):
        LLM(str(model_dir), device="cpu", num_kv_blocks=16)


@pytest.mark.parametrize("shard", ["../x.safetensors", "/etc/x.safetensors", "sub/../../x.safetensors"])
def test_index_entries_outside_the_model_directory_are_refused(tmp_path: Path, shard: str) -> None:
    """Before, a shard beside the directory (or anywhere) was read."""
    model_dir = write_hf_llama(tmp_path / "model")
    (model_dir / "model.safetensors").rename(tmp_path / "x.safetensors")
    index = model_dir / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors", "model.norm.weight": shard}})
    )
    with pytest.raises(
        ValueError,
        match=re.escape(f"{index}: weight_map['model.norm.weight'] = {shard!r} is not a file name inside {model_dir}"),
    ):
        LLM(str(model_dir), device="cpu", num_kv_blocks=16)


def test_garbage_tokenizer_json_names_the_directory_and_file(
    capsys: pytest.CaptureFixture[str], pydoc_dir: Path
) -> None:
    (pydoc_dir / "tokenizer.json").write_text("garbage")
    code, line = error_line(capsys, [*GENERATE, "--model", str(pydoc_dir)])
    assert code == 2
    assert line.startswith(
        f"pagedkv: error: {pydoc_dir}: transformers' AutoTokenizer could not load the tokenizer "
        "from tokenizer.json, tokenizer_config.json (and config.json): "
    ), line


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("garbage", " is not valid JSON: "),
        (
            '{"eos_token_id": -5}',
            ": eos_token_id -5 must be a token id or a list of them, ints in [0, 258)",
        ),  # accepted
        ('{"eos_token_id": [257, 258]}', ": eos_token_id [257, 258] must be"),
        ('{"eos_token_id": "257"}', ": eos_token_id '257' must be"),
    ],
)
def test_bad_generation_config_names_the_file(pydoc_dir: Path, text: str, message: str) -> None:
    gen = pydoc_dir / "generation_config.json"
    gen.write_text(text)
    with pytest.raises(ValueError, match="^" + re.escape(f"{gen}{message}")):
        LLM(str(pydoc_dir), device="cpu", num_kv_blocks=16)


def test_generation_config_eos_ids_are_added(pydoc_dir: Path) -> None:
    (pydoc_dir / "generation_config.json").write_text('{"eos_token_id": [7, 257]}')
    assert LLM(str(pydoc_dir), device="cpu", num_kv_blocks=16).eos_token_ids == [7, 257]


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        # Before: `KeyError: 'factor'` from the model build, or transformers' own KeyError from the tokenizer load.
        (
            {"rope_type": "linear", "rope_theta": 10000.0},
            r"RoPE scaling \{.*'rope_type': 'linear'.*\} has no 'factor', "
            r"which its type needs",
        ),
        ({"rope_type": "bogus", "rope_theta": 10000.0}, r"RoPE scaling type 'bogus' is not supported"),  # named no file
    ],
)
def test_config_json_rope_scaling_is_checked_before_the_tokenizer_loads(
    capsys: pytest.CaptureFixture[str], pydoc_dir: Path, rope: dict, message: str
) -> None:
    edit_config_json(pydoc_dir, rope_parameters=rope)
    code, line = error_line(capsys, [*GENERATE, "--model", str(pydoc_dir)])
    assert code == 2
    assert re.fullmatch("pagedkv: error: " + re.escape(f"{pydoc_dir / 'config.json'}: ") + message + ".*", line), line


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # Before: "cannot convert dictionary update sequence element #0 to a sequence" (Python's own words).
        (
            dict(rope_parameters=[10000.0]),
            r"rope_parameters must be an object such as \{\"rope_type\": .*got \[10000\.0\]\.",
        ),
        (dict(rope_parameters="default"), r"rope_parameters must be an object .*got 'default'\."),
        # Before: "unsupported operand type(s) for /: 'Tensor' and 'str'", naming no file.
        (
            dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": "4"}),
            r"rope_parameters\['factor'\] must be a number > 0, got '4'\.",
        ),
        (
            dict(rope_scaling={"rope_type": "linear", "factor": -2.0}),
            r"rope_scaling\['factor'\] must be a number > 0, got -2\.0\.",
        ),
        # Before: "... could not load the tokenizer ...": transformers' tokenizer read config.json and failed on it.
        (dict(bos_token_id="<s>"), r"bos_token_id '<s>' must be a token id \(an int in \[0, 258\)\) or null\."),
        (dict(pad_token_id=[0]), r"pad_token_id \[0\] must be a token id \(an int\) or null\."),
    ],
)
def test_a_bad_config_json_is_named_as_the_config_error(
    capsys: pytest.CaptureFixture[str], pydoc_dir: Path, changes: dict, message: str
) -> None:
    edit_config_json(pydoc_dir, **changes)
    code, line = error_line(capsys, [*GENERATE, "--model", str(pydoc_dir)])
    assert code == 2
    assert re.fullmatch("pagedkv: error: " + re.escape(f"{pydoc_dir / 'config.json'}: ") + message, line), line


def test_config_json_eos_ids_are_checked(tmp_path: Path) -> None:
    """(Its other fields' errors name the file too: test_config_json_numbers_are_checked_by_name.)"""
    model_dir = write_hf_llama(tmp_path / "model")
    edit_config_json(model_dir, eos_token_id=[2, 128])
    with pytest.raises(ValueError, match=re.escape(f"{model_dir / 'config.json'}: eos_token_id [2, 128] must be")):
        load_config(str(model_dir))


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        '{"format": "pagedkv-trace", "version": 1}',
        '{"format": "pagedkv-trace", "version": 1, "engine": [], "steps": []}',
    ],
)
def test_malformed_trace_file_names_the_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "trace.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="^" + re.escape(f"{path} is not a readable pagedkv-trace v1 file: ")):
        StepTrace.load(path)


# ---- which model a name means ------------------------------------------------------------------


def test_a_local_directory_named_like_a_preset_wins_and_is_named_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As transformers reads a local path first. Before, the preset shadowed the directory."""
    write_hf_llama(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger="pagedkv"):
        first = LLM("tiny", device="cpu", num_kv_blocks=16)
        LLM("tiny", device="cpu", num_kv_blocks=16)
    assert first.model_config.vocab_size == 128 != PRESETS["tiny"].vocab_size  # the directory's config
    warnings = [r.getMessage() for r in caplog.records if "not the preset" in r.getMessage()]
    assert warnings == [
        f"Model 'tiny': reading the local directory ./tiny ({tmp_path / 'tiny'}), not the preset of "
        "that name; rename the directory to use the preset."
    ]
    (tmp_path / "tiny" / "config.json").unlink()  # a folder that holds no model does not count
    assert LLM("tiny", device="cpu", num_kv_blocks=16).model_config.vocab_size == PRESETS["tiny"].vocab_size


# ---- argparse's own errors, failed requests, a user's backend from the command line --------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--max-num-seqs", "x"], "argument --max-num-seqs: invalid int value: 'x' (pagedkv generate"),
        (["generate", "--bogus"], "unrecognized arguments: --bogus (pagedkv --help"),
        (["lab", "check"], "the following arguments are required: name, file (pagedkv lab check --help"),
        (["nonsense"], "argument command: invalid choice: 'nonsense'"),
    ],
)
def test_argument_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """Before, argparse printed the whole usage first: 26 lines for `generate`, the error last."""
    code, line = error_line(capsys, argv)
    assert code == 2
    assert line.startswith(f"pagedkv: error: {message}"), line


@pytest.fixture
def nan_model(tmp_path: Path) -> Path:
    """A Llama whose output projection is NaN: every request's logits are NaN, so every request fails."""
    model_dir = write_hf_llama(tmp_path / "nan")
    path = model_dir / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    tensors["lm_head.weight"] = torch.full_like(tensors["lm_head.weight"], float("nan"))
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


@pytest.mark.parametrize("stream", [False, True])
def test_generate_exits_1_when_every_request_failed(
    capsys: pytest.CaptureFixture[str], nan_model: Path, stream: bool
) -> None:
    """Before, it exited 0 (each failure was only a line of output)."""
    argv = [*GENERATE, "--model", str(nan_model), "--prompt-token-ids", "4,5", *(["--stream"] if stream else [])]
    with pytest.raises(SystemExit) as exited:
        cli(argv)
    assert exited.value.code == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert re.fullmatch(r"pagedkv: error: all 2 requests failed; the first: .*NaN.*", last), last


BACKEND_PLUGIN = """
from pagedkv.attention.backends.torch_ref import TorchRefBackend
from pagedkv.attention.selector import register_backend


@register_backend
class MyBackend(TorchRefBackend):
    @staticmethod
    def get_name() -> str:
        return "MY_CLI_BACKEND"
"""


@pytest.fixture
def plugin_file(tmp_path: Path) -> Iterator[Path]:
    from pagedkv.attention.selector import unregister_backend

    path = tmp_path / "my_cli_backend.py"
    path.write_text(BACKEND_PLUGIN)
    yield path
    unregister_backend("MY_CLI_BACKEND")
    sys.modules.pop("my_cli_backend", None)
    if str(tmp_path) in sys.path:  # --load put the file's folder there
        sys.path.remove(str(tmp_path))


def test_a_registered_backend_is_chosen_from_the_command_line(
    capsys: pytest.CaptureFixture[str], plugin_file: Path
) -> None:
    """--load imports the user's file first; before, --attention-backend MY_CLI_BACKEND was "Unknown"
    (the CLI never ran the code that registers it). Its tokens are TORCH_REF's, which it subclasses."""
    argv = [*GENERATE[:3], "--model", "tiny", "--prompt-token-ids", "4,5,6", "--max-tokens", "6", "--stream"]
    cli([*argv, "--attention-backend", "TORCH_REF"])
    reference = capsys.readouterr().out  # a line per token: [request id] token id 'text'
    assert len(re.findall(r"^\[0\] \d+ ", reference, re.MULTILINE)) == 6, reference
    cli([*argv, "--load", str(plugin_file), "--attention-backend", "MY_CLI_BACKEND"])
    assert capsys.readouterr().out == reference
    cli(["backends", "--device", "cpu", "--load", str(plugin_file)])
    assert re.search(r"^  MY_CLI_BACKEND +ok$", capsys.readouterr().out, re.MULTILINE)


@pytest.mark.slow  # two tensor-parallel engines: 20 s on 2 cores
def test_a_loaded_backend_reaches_the_tensor_parallel_workers(
    capsys: pytest.CaptureFixture[str], plugin_file: Path
) -> None:
    """The spawned rank imports the file by its name (its folder is on the sys.path it starts from).
    Before that, the rank failed on `No module named 'my_cli_backend'` and rank 0 timed out waiting."""
    argv = [
        *GENERATE[:3],
        "--prompt-token-ids",
        "4,5,6",
        "--max-tokens",
        "4",
        "--stream",
        "--tensor-parallel-size",
        "2",
    ]
    cli([*argv, "--attention-backend", "TORCH_REF"])
    reference = capsys.readouterr().out
    assert len(re.findall(r"^\[0\] \d+ ", reference, re.MULTILINE)) == 4, reference
    cli([*argv, "--load", str(plugin_file), "--attention-backend", "MY_CLI_BACKEND"])
    assert capsys.readouterr().out == reference


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_file.py", "--load no_such_file.py: no such file"),
        ("no_such_module_here", "--load no_such_module_here: no module of that name is importable here"),
    ],
)
def test_load_names_what_it_could_not_import(capsys: pytest.CaptureFixture[str], spec: str, message: str) -> None:
    code, line = error_line(capsys, [*GENERATE, "--load", spec])
    assert (code, line.startswith(f"pagedkv: error: {message}")) == (2, True), line
