"""`CUDAGraphMode`: how decode-only steps and mixed steps are run.

A mode is a pair of routines, one for batches where every request decodes a single
token (uniform decode) and one for everything else (mixed prefill + decode):

    mode                 decode routine   mixed routine
    NONE                 NONE             NONE          every step eager
    PIECEWISE            PIECEWISE        PIECEWISE     graphs between the attention ops
    FULL                 FULL             FULL          one graph for the whole model
    FULL_DECODE_ONLY     FULL             NONE
    FULL_AND_PIECEWISE   FULL             PIECEWISE

This module imports nothing from pagedkv: `pagedkv.config` (the lowest layer) imports the
enum from here, so it must stay a leaf.
"""

from __future__ import annotations

import enum


class CUDAGraphMode(enum.Enum):
    """How a step is run: eagerly, as piecewise graphs between attention ops, or one full graph.

    NONE, PIECEWISE and FULL are also the *runtime* modes a single step runs in; the two
    combined modes only say which of those a decode step and a mixed step get.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = 3
    FULL_AND_PIECEWISE = 4

    def decode_mode(self) -> CUDAGraphMode:
        """The routine of uniform-decode batches (every request one query token)."""
        return _ROUTINES[self][0]

    def mixed_mode(self) -> CUDAGraphMode:
        """The routine of every other batch (prefills, chunks, mixed prefill + decode)."""
        return _ROUTINES[self][1]

    def has_full_cudagraphs(self) -> bool:
        """Some batches replay one graph of the whole model (attention included)."""
        return CUDAGraphMode.FULL in _ROUTINES[self]

    def requires_piecewise_compilation(self) -> bool:
        """Some batches run piecewise graphs, which only exist when attention is split out."""
        return CUDAGraphMode.PIECEWISE in _ROUTINES[self]

    def without_piecewise(self) -> CUDAGraphMode:
        """The same mode with its piecewise routine run eagerly (PIECEWISE -> NONE,
        FULL_AND_PIECEWISE -> FULL_DECODE_ONLY); other modes are returned unchanged."""
        decode, mixed = (CUDAGraphMode.NONE if r is CUDAGraphMode.PIECEWISE else r for r in _ROUTINES[self])
        return CUDAGraphMode.from_routines(decode, mixed)

    @classmethod
    def from_routines(cls, decode: CUDAGraphMode, mixed: CUDAGraphMode) -> CUDAGraphMode:
        """The mode whose (decode, mixed) routines are the given pair."""
        for mode, routines in _ROUTINES.items():
            if routines == (decode, mixed):
                return mode
        raise ValueError(
            f"No CUDAGraphMode runs decode batches as {decode.name} and mixed batches as {mixed.name}; "
            f"the pairs are {', '.join(f'{m.name}={tuple(r.name for r in rs)}' for m, rs in _ROUTINES.items())}."
        )

    @classmethod
    def parse(cls, value: CUDAGraphMode | str) -> CUDAGraphMode:
        """A mode, or its name in any case ("full_and_piecewise")."""
        if isinstance(value, CUDAGraphMode):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"Unknown cudagraph_mode {value!r}; use a CUDAGraphMode or one of {list(cls.__members__)}.")


_ROUTINES: dict[CUDAGraphMode, tuple[CUDAGraphMode, CUDAGraphMode]] = {
    CUDAGraphMode.NONE: (CUDAGraphMode.NONE, CUDAGraphMode.NONE),
    CUDAGraphMode.PIECEWISE: (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE),
    CUDAGraphMode.FULL: (CUDAGraphMode.FULL, CUDAGraphMode.FULL),
    CUDAGraphMode.FULL_DECODE_ONLY: (CUDAGraphMode.FULL, CUDAGraphMode.NONE),
    CUDAGraphMode.FULL_AND_PIECEWISE: (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE),
}
"""mode -> (decode routine, mixed routine): the table in the module docstring."""
