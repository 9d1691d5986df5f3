"""The trained `tiny-pydoc` preset: the shipped checkpoint, checked as an artifact.

pagedkv and transformers load the same directory and must agree on logits; its tokenizer must
encode like pagedkv's ByteTokenizer; the held-out loss in training_log.json must come out of
the shipped weights again (computed here without the training script's code); greedy text
must be made of words from Python's documentation.
"""

from __future__ import annotations

import json
import math
import re
import string
import sys

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.models.loader import TRAINED_PRESETS
from pagedkv.models.tokenizer import ByteTokenizer
from tests.reference import LogitsRecorder, reference_logits

transformers = pytest.importorskip("transformers")

MODEL_DIR = TRAINED_PRESETS["tiny-pydoc"]
LOG = json.loads((MODEL_DIR / "training_log.json").read_text())
PROMPT = "The for statement"


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def test_shipped_files() -> None:
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 10 * 1024 * 1024
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert [p["step"] for p in LOG["curve"]] == sorted(p["step"] for p in LOG["curve"])
    assert LOG["curve"][-1]["step"] == LOG["steps"] and LOG["val_loss"] == LOG["curve"][-1]["val_loss"]


@pytest.mark.parametrize("text", [PROMPT, "", "  tabs\tand\nnewlines\r\n", "é € 😀 \x00\x7f", "<s> and </s> are text"])
def test_tokenizer_matches_byte_tokenizer(text: str) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    ids = ByteTokenizer().encode(text)
    assert hf.encode(text) == ids
    assert hf.decode(ids, skip_special_tokens=True) == text
    # What a model emits: bytes, with EOS/BOS anywhere.
    emitted = [*text.encode("utf-8"), 257, 72, 256, 105]
    assert hf.decode(emitted, skip_special_tokens=True) == ByteTokenizer().decode(emitted) == text + "Hi"


@pytest.mark.parametrize("model", ["tiny-pydoc", str(MODEL_DIR)])
def test_pagedkv_logits_match_transformers(model: str, hf_model: torch.nn.Module) -> None:
    # Small blocks and a small token budget: the prompt is prefilled in chunks over several pages.
    llm = LLM(model, device="cpu", dtype=torch.float32, block_size=4, num_kv_blocks=32, max_num_batched_tokens=8)
    recorder = LogitsRecorder(llm)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    generated = out.outputs[0].token_ids
    ours = torch.stack(recorder.rows[out.request_id]).float()
    expected = reference_logits(hf_model, out.prompt_token_ids, generated)
    assert out.prompt_token_ids == ByteTokenizer().encode(PROMPT)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    assert out.outputs[0].text == ByteTokenizer().decode(generated)


def _held_out_stream() -> torch.Tensor:
    """The validation text as train_tiny_pydoc's docstring defines it, rebuilt here independently."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for i, key in enumerate(sorted(topics)):
        if i % 10 == 5:
            ids += [256, *topics[key].encode("utf-8"), 257]
    return torch.tensor(ids)


@torch.no_grad()
def test_recorded_held_out_loss_is_reproduced(hf_model: torch.nn.Module) -> None:
    python = "%d.%d" % sys.version_info[:2]
    if LOG["topics_python"] != python:
        pytest.skip(f"trained on Python {LOG['topics_python']}'s pydoc topics; this is Python {python}, whose differ")
    stream, seq_len = _held_out_stream(), LOG["seq_len"]
    assert len(stream) == LOG["val_tokens"]
    total, count = 0.0, 0
    for start in range(0, len(stream) - 1, seq_len):  # windows overlap by one: each token predicted once
        window = stream[start : start + seq_len + 1][None]
        n = window.shape[1] - 1
        total += hf_model(window, labels=window).loss.item() * n  # HF shifts labels: mean over n
        count += n
    assert count == len(stream) - 1
    assert total / count == pytest.approx(LOG["val_loss"], abs=1e-4)
    assert total / count < 0.5 * math.log(258)  # far below a uniform guess over the vocabulary


def test_greedy_continuation_is_documentation_words() -> None:
    from pydoc_data.topics import topics

    llm = LLM("tiny-pydoc", device="cpu", dtype=torch.float32)
    # 80 bytes: the text starts with a heading's "****" underline, as the topics' headings do.
    text = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=80))[0].outputs[0].text
    assert sum(c in string.printable for c in text) >= 0.95 * len(text), text
    corpus_words = set(re.findall(r"[A-Za-z]+", " ".join(topics.values())))
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 8, text
    assert sum(w in corpus_words for w in words) >= 0.8 * len(words), text
    assert len(set(words)) >= 6, text  # not one word repeated
