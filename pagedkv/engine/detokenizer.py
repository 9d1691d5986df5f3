"""`IncrementalDetokenizer`: a request's output text, updated from its newest tokens only."""

from __future__ import annotations

from pagedkv.models.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
"""What a decoder writes for bytes that do not form a character (yet)."""


class IncrementalDetokenizer:
    """Keeps the text of a growing list of token ids, decoding a few recent ids per call.

    The engine returns every request's text after every step. Decoding the whole output each
    time costs O(length) per step, O(length^2) per request (and a Hugging Face `decode` call of
    a thousand ids takes tens of microseconds, times every running request). Instead the text is
    kept in two parts (the offsets only move forward):

        token ids:  | 0 ........................ | prefix_offset ... | read_offset ... | newest |
        text:       | self._text = decode(ids[:read_offset]), final   | tail, decoded each call |

    Each call decodes `ids[prefix_offset:]` and `ids[prefix_offset:read_offset]`; what the first
    has beyond the second is the tail. The window starts one step back (at the previous
    read_offset) because a tokenizer decodes a token differently at the start of a text
    (SentencePiece drops the space of "▁word" there): both decodes start alike, so the slice
    keeps the space. When the window's text does not end in U+FFFD (bytes of a character still
    incomplete), the tail becomes final and the offsets move on.

    For a byte-level tokenizer such as the presets' `ByteTokenizer` every offset sits between
    whole characters, so the text equals decoding all ids at once, call after call. For other
    tokenizers it is the same in all but rare cases (vLLM's way), e.g. a clean-up of spaces
    that would join text across the window's start.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def text(self, token_ids: list[int]) -> str:
        """The text of `token_ids`: the ids seen by the last call, plus any new ones at the end."""
        if len(token_ids) < self._read_offset:
            raise ValueError(
                f"token_ids shrank to {len(token_ids)} ids, but {self._read_offset} were decoded already: "
                "an IncrementalDetokenizer follows one growing sequence"
            )
        settled = self.tokenizer.decode(token_ids[self._prefix_offset:self._read_offset])
        window = self.tokenizer.decode(token_ids[self._prefix_offset:])
        tail = window[len(settled):]
        if window.endswith(REPLACEMENT_CHAR):
            return self._text + tail  # may still change: the next token can complete a character
        self._text += tail
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        return self._text
