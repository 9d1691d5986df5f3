"""`IncrementalDetokenizer`: a request's output text, updated from its newest tokens only, and
`detokenize_batch`: every output of a step brought up to date in one tokenizer call."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.models.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
"""What a decoder writes for bytes that do not form a character (yet)."""


class IncrementalDetokenizer:
    """Keeps the text of a growing list of token ids, decoding a few recent ids per call.

    The engine returns every streamed request's text after every step. Decoding the whole output
    each time costs O(length) per step, O(length^2) per request (and a Hugging Face `decode` call
    of a thousand ids takes tens of microseconds, times every running request). Instead the text
    is kept in two parts (the offsets only move forward):

        token ids:  | 0 ........................ | prefix_offset ... | read_offset ... | newest |
        text:       | self._text = decode(ids[:read_offset]), final   | tail, decoded each call |

    Each call decodes `ids[prefix_offset:]` and `ids[prefix_offset:read_offset]`; what the first
    has beyond the second is the tail. The window starts one step back (at the previous
    read_offset) because a tokenizer decodes a token differently at the start of a text
    (SentencePiece drops the space of "▁word" there): both decodes start alike, so the slice
    keeps the space. When the window's text does not end in U+FFFD (bytes of a character still
    incomplete), the tail becomes final and the offsets move on. When it does, the text before
    the newest id becomes final if decoding that id after it only added text: a character still
    incomplete decodes to one U+FFFD however many of its bytes have come, so a newest id that
    only continued it adds nothing. (A U+FFFD that is really in the text, as a random model's
    ids past the bytes give, never completes: without this rule the window would grow by a token
    per step for good, and each step decode the whole output since.)

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

    def pieces(self, token_ids: list[int]) -> list[list[int]]:
        """The id lists whose text `update` needs: the settled part of the window, the window,
        and (when it has two new ids or more) the window without the newest id; none when every id
        is settled already."""
        if len(token_ids) < self._read_offset:
            raise ValueError(
                f"token_ids shrank to {len(token_ids)} ids, but {self._read_offset} were decoded already: "
                "an IncrementalDetokenizer follows one growing sequence"
            )
        if len(token_ids) == self._read_offset:
            return []
        start, cut = self._prefix_offset, len(token_ids) - 1
        pieces = [token_ids[start : self._read_offset], token_ids[start:]]
        return pieces + [token_ids[start:cut]] if cut > self._read_offset else pieces

    def update(self, token_ids: list[int], texts: Sequence[str]) -> str:
        """The text of `token_ids`, given the decoded `pieces(token_ids)`."""
        if len(token_ids) == self._read_offset:
            # Nothing new since the text settled: the engine asks again for the same ids when a batch
            # raised (each text is then made alone) and for generate()'s final outputs. Settling the
            # empty tail would start the next window at the newest id (a word's space lost).
            return self._text
        settled, window, *before_newest = texts
        if not window.endswith(REPLACEMENT_CHAR):
            self._settle(window[len(settled) :], len(token_ids))
            return self._text
        if before_newest and len(window) > len(before_newest[0]) and window.startswith(before_newest[0]):
            self._settle(before_newest[0][len(settled) :], len(token_ids) - 1)
            return self._text + window[len(before_newest[0]) :]
        return self._text + window[len(settled) :]  # may still change: the next token can complete a character

    def text(self, token_ids: list[int]) -> str:
        """The text of `token_ids`: the ids seen by the last call, plus any new ones at the end."""
        return self.update(token_ids, self.tokenizer.decode_batch(self.pieces(token_ids)))

    def _settle(self, tail: str, read_offset: int) -> None:
        self._text += tail
        self._prefix_offset, self._read_offset = self._read_offset, read_offset


def detokenize_batch(tokenizer: Tokenizer, items: Sequence[tuple[IncrementalDetokenizer, list[int]]]) -> list[str]:
    """Each (detokenizer, its token ids) -> its text, with one `decode_batch` call for them all
    (a Hugging Face fast tokenizer decodes a batch in Rust, without a Python call per sequence)."""
    pieces = [detokenizer.pieces(ids) for detokenizer, ids in items]
    texts = iter(tokenizer.decode_batch([p for request_pieces in pieces for p in request_pieces]))
    return [
        detokenizer.update(ids, [next(texts) for _ in request_pieces])
        for (detokenizer, ids), request_pieces in zip(items, pieces)
    ]


def find_stop_string(text: str, num_new_chars: int, stop: Sequence[str], include: bool) -> tuple[str, int] | None:
    """The first `stop` string in the newest `num_new_chars` characters of `text` (a match may begin up to
    len(stop) - 1 characters earlier, in text searched before), and the length the text is cut to: before
    the string, or after it with `include`. None when none ends in the new text.

    As vLLM's `check_stop_strings` (vllm/v1/engine/detokenizer.py), only the new text is searched each
    step, so a request's stop check costs O(new text), not O(output); unlike it, of several strings
    found in one step's new text the earliest in the text wins, not the first in `stop`."""
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(len(text) - num_new_chars - len(s) + 1, 0)
        index = text.find(s, start)
        if index != -1 and (best is None or index < best[1]):
            best = (s, index)
    if best is None:
        return None
    s, index = best
    return s, index + len(s) if include else index
