"""IncrementalDetokenizer against decoding the whole output at once (the text the engine used to return)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.detokenizer import IncrementalDetokenizer, detokenize_batch
from pagedkv.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

TEXTS = ["the lazy fox says hello world", "naïve café, déjà vu: 東京 タワー 😀!", "print('hi')  # two  spaces"]
CORPUS = [*TEXTS, "the quick brown fox jumps over the lazy dog", "hello world from a café in 東京 😀"] * 20


def incremental_texts(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The detokenizer's text after each new id, fed one at a time as the engine does."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.text(ids[: n + 1]) for n in range(len(ids))]


def random_bytes_ids(rng: random.Random) -> list[int]:
    """UTF-8 of mixed-width characters, cut anywhere, with invalid bytes, BOS/EOS and ids past EOS."""
    ids = list("".join(rng.choice("aé東😀 ") for _ in range(rng.randint(0, 12))).encode())
    for _ in range(rng.randint(0, 4)):
        ids.insert(rng.randint(0, len(ids)), rng.choice([0x80, 0xBF, 0xE6, 0xF0, 0xFF, 256, 257, 300, 1000]))
    return ids


def test_byte_tokenizer_text_equals_whole_decode_after_every_token() -> None:
    tokenizer = ByteTokenizer()
    rng = random.Random(0)
    for _ in range(300):
        ids = random_bytes_ids(rng)
        assert incremental_texts(tokenizer, ids) == [tokenizer.decode(ids[: n + 1]) for n in range(len(ids))], ids


def test_a_character_split_over_tokens_shows_as_u_fffd_until_complete() -> None:
    ids = list("é東".encode())  # 2 + 3 bytes
    texts = incremental_texts(ByteTokenizer(), ids)
    assert texts == ["\ufffd", "é", "é\ufffd", "é\ufffd", "é東"]


def hf_tokenizer(tmp_path: Path, kind: str) -> HFTokenizer:
    """A small Hugging Face tokenizer trained here: SentencePiece-like ("▁" marks a space, dropped at
    the start of a text) or byte-level BPE (characters split over several tokens)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    if kind == "metaspace":
        raw.pre_tokenizer, raw.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    else:
        raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    raw.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(tmp_path / kind)
    return HFTokenizer(str(tmp_path / kind))


@pytest.mark.parametrize("kind", ["metaspace", "byte_level"])
def test_hugging_face_tokenizers(tmp_path: Path, kind: str) -> None:
    tokenizer = hf_tokenizer(tmp_path, kind)
    eos = tokenizer.eos_token_id
    naive_texts = []
    for text in TEXTS:
        ids = [*tokenizer.encode(text), eos]  # a special token at the end decodes to nothing
        texts = incremental_texts(tokenizer, ids)
        assert texts[-1] == tokenizer.decode(ids) == text
        if kind == "byte_level":  # bytes again: every offset is a character boundary
            assert texts == [tokenizer.decode(ids[: n + 1]) for n in range(len(ids))]
        naive_texts.append("".join(tokenizer.decode([i]) for i in ids))
    # Why the window starts before the new tokens: decoded alone, "▁lazy" loses its space
    # (Metaspace), and a byte-level token loses the bytes of a character begun before it.
    assert naive_texts != TEXTS


@pytest.mark.parametrize("kind", ["metaspace", "byte_level"])
def test_a_text_made_again_for_the_same_ids_changes_no_later_text(tmp_path: Path, kind: str) -> None:
    """The engine makes a text again for the same ids when a step's batched decode raised (each
    request's text is then made alone) and for generate()'s final outputs. Before, the window then
    started at the newest id, and Metaspace lost the space before the next word ("thelazy")."""
    tokenizer = hf_tokenizer(tmp_path, kind)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        detokenizer = IncrementalDetokenizer(tokenizer)
        twice = [[detokenizer.text(ids[: n + 1]) for _ in range(2)] for n in range(len(ids))]
        assert twice == [[t, t] for t in incremental_texts(tokenizer, ids)]


class CountingTokenizer(ByteTokenizer):
    """The presets' tokenizer, counting the ids and the calls it decodes."""

    def __init__(self) -> None:
        self.ids_decoded, self.calls = 0, 0

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        self.calls += 1
        self.ids_decoded += sum(map(len, batch))
        return super().decode_batch(batch)


def test_a_random_models_replacement_characters_do_not_grow_the_window() -> None:
    """Ids past the bytes (what a random model mostly emits) decode to a final U+FFFD: the work per
    new token stays bounded instead of growing with the output (it grew to the whole output)."""
    tokenizer = CountingTokenizer()
    ids = [65] + [1000 + i for i in range(399)]
    texts = incremental_texts(tokenizer, ids)
    assert texts[-1] == ByteTokenizer().decode(ids)
    assert tokenizer.ids_decoded < 20 * len(ids)


def test_one_batched_decode_per_step_gives_each_requests_text() -> None:
    tokenizer = CountingTokenizer()
    rng = random.Random(1)
    streams = [random_bytes_ids(rng) + random_bytes_ids(rng) for _ in range(6)]
    detokenizers = [IncrementalDetokenizer(tokenizer) for _ in streams]
    for n in range(1, max(map(len, streams)) + 1):
        live = [(d, s[:n]) for d, s in zip(detokenizers, streams) if len(s) >= n]
        calls = tokenizer.calls
        assert detokenize_batch(tokenizer, live) == [ByteTokenizer().decode(ids) for _, ids in live]
        assert tokenizer.calls == calls + 1


def test_a_shrinking_sequence_is_refused() -> None:
    detokenizer = IncrementalDetokenizer(ByteTokenizer())
    detokenizer.text([72, 105])
    with pytest.raises(ValueError, match="token_ids shrank to 1 ids, but 2 were decoded"):
        detokenizer.text([72])


def test_engine_streams_the_whole_decode_and_finishes_with_it() -> None:
    """Random weights emit ids past EOS and invalid UTF-8: each streamed text is still the decode of
    the tokens so far, and the final output (returned after the request is forgotten) too."""
    llm = LLM("tiny", device="cpu", dtype="float32", num_kv_blocks=32)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    req_id = llm.add_request("Hello", params)
    streamed = []
    while llm.has_unfinished_requests():
        streamed += [o for o in llm.step() if o.request_id == req_id]
    for out in streamed:
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert "\ufffd" in streamed[-1].outputs[0].text  # the hard case was there
    final = llm.generate(["Hello"], params)[0].outputs[0]
    assert final.token_ids == streamed[-1].outputs[0].token_ids and final.text == streamed[-1].outputs[0].text


def test_detokenizer_decodes_a_bounded_window_per_call() -> None:
    """Each call decodes a few recent ids. A prefix offset that never moves gives the same text,
    but every call decodes the whole output again: O(n^2) per request, what the class avoids."""
    from pagedkv.engine.detokenizer import IncrementalDetokenizer
    from pagedkv.models.tokenizer import ByteTokenizer

    class Counting(ByteTokenizer):
        longest = 0

        def decode(self, ids):  # type: ignore[override]
            Counting.longest = max(Counting.longest, len(ids))
            return super().decode(ids)

    tokenizer = Counting()
    ids = list(("abc é東😀 " * 40).encode())
    detokenizer = IncrementalDetokenizer(tokenizer)
    for n in range(len(ids)):
        assert detokenizer.text(ids[: n + 1]) == ByteTokenizer().decode(ids[: n + 1])
    assert Counting.longest <= 8  # a 4-byte character pending plus the window's one step back
