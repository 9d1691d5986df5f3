"""Tokenizers: a byte-level one for presets, the model directory's own Hugging Face one otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from pagedkv.models.loader import TRAINED_PRESETS


class Tokenizer(Protocol):
    @property
    def eos_token_id(self) -> int | None: ...  # read-only here, so a class attribute of int matches

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def decode_batch(self, batch: list[list[int]]) -> list[str]: ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255), plus BOS 256 and EOS 257."""

    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        """Bytes -> UTF-8 text; BOS and EOS are skipped (as Hugging Face's skip_special_tokens does).

        Random-init models emit ids above EOS too: each becomes one U+FFFD where it stands, so
        `decode([72, 300, 105])` is "H\ufffdi". Invalid UTF-8 byte runs also decode to U+FFFD.

        Every id that is not a byte becomes 0xFF, a byte that never occurs in UTF-8: it ends any
        character begun before it and decodes to one U+FFFD itself, so one C-level decode of the
        whole list gives the same text as decoding the byte runs between such ids separately.
        (The engine decodes every request's text after every step: this is on its hot path.)
        """
        special = (self.bos_token_id, self.eos_token_id)
        data = bytes(t if 0 <= t < 256 else 0xFF for t in token_ids if t not in special)
        return data.decode("utf-8", errors="replace")

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return [self.decode(token_ids) for token_ids in batch]


class HFTokenizer:
    """Wraps `transformers.AutoTokenizer` loaded from a local directory."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self.eos_token_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        text = self._tok.decode(token_ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one list of ids decodes to one string (a batch would be a list)
        return text

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return self._tok.batch_decode(batch, skip_special_tokens=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
"""A directory with any of these has a tokenizer of its own."""


def get_tokenizer(model: str, is_preset: bool) -> Tokenizer | None:
    """ByteTokenizer for presets, trained ones included; the directory's tokenizer if it has one
    (and transformers is installed)."""
    if is_preset or model in TRAINED_PRESETS:
        return ByteTokenizer()
    path = Path(model)
    files = [f for f in TOKENIZER_FILES if (path / f).is_file()]
    if not files:
        return None
    try:
        return HFTokenizer(model)
    except ImportError:
        return None
    except Exception as exc:  # transformers and tokenizers raise many types (Exception itself for bad JSON)
        message = " ".join(str(exc).split()).rstrip(".")
        raise ValueError(
            f"{path}: transformers' AutoTokenizer could not load the tokenizer from {', '.join(files)} (and "
            f"config.json): {type(exc).__name__}: {message}. Fix the file at fault, or save the tokenizer again with "
            "its save_pretrained."
        ) from exc
