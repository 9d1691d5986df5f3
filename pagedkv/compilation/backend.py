"""The torch.compile backend: split at the attention ops, compile the pieces, stitch.

    Dynamo graph of the whole model (traced once, token dimension symbolic)
      -> split_graph at CompilationConfig.splitting_ops
      -> run the split graph on fake inputs, to learn each piece's (symbolic) inputs
      -> compile each distinct piece once ("inductor" or "eager"), wrap it (`PieceWrapper`)
      -> return the stitching GraphModule: pieces compiled, attention ops eager between them

The wrapper hook is where CUDA graphs go: a wrapper gets the compiled piece and returns a
callable that may capture and replay it per batch size (reading the runtime mode and the
`BatchDescriptor` from the forward context). Without one, pieces are called as they are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode

from pagedkv.compilation.split import SplitItem, split_graph, structure_key

logger = logging.getLogger("pagedkv")

PIECE_COMPILERS = ("eager", "inductor")


@dataclass
class CompiledPiece:
    """One compiled piece of the model, as a `PieceWrapper` receives it."""

    index: int
    """Position among the pieces (splitting ops not counted)."""
    num_pieces: int
    name: str
    """Its submodule name in the split graph ("submod_4")."""
    runnable: Callable[..., Any]
    """The compiled piece: call it with the piece's inputs (tensors and token-count SymInts)."""

    @property
    def is_last(self) -> bool:
        """The last piece's outputs leave the model (a graph wrapper must not reuse them)."""
        return self.index == self.num_pieces - 1


class PieceWrapper(Protocol):
    """Turns a compiled piece into what the split graph calls, e.g. a CUDA graph wrapper
    that captures `piece.runnable` once per capture size and replays it afterwards."""

    def __call__(self, piece: CompiledPiece) -> Callable[..., Any]: ...


class PiecewiseBackend:
    """A `torch.compile(backend=...)` that splits the graph at `splitting_ops`.

    One instance compiles one model. Counters for tests and notebooks: `num_graphs`
    (Dynamo graphs received: 1 per trace), `num_piece_compiles` (distinct pieces compiled).
    """

    def __init__(
        self,
        splitting_ops: Sequence[str],
        piece_compiler: str,
        wrap_piece: PieceWrapper | None = None,
    ) -> None:
        if piece_compiler not in PIECE_COMPILERS:
            raise ValueError(f"piece_compiler must be one of {PIECE_COMPILERS}, got {piece_compiler!r}.")
        self.splitting_ops = list(splitting_ops)
        self.piece_compiler = piece_compiler
        self.wrap_piece = wrap_piece
        self.num_graphs = 0
        self.num_piece_compiles = 0
        self.graph: fx.GraphModule | None = None
        """The last Dynamo graph received (before the split)."""
        self.split_gm: fx.GraphModule | None = None
        """The stitching module; its submodules print as the traced pieces."""
        self.items: list[SplitItem] = []
        self.pieces: list[CompiledPiece] = []

    def __call__(self, graph: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        self.num_graphs += 1
        split, items = split_graph(graph, self.splitting_ops)
        piece_items = [item for item in items if not item.is_splitting_op]
        piece_args = _piece_example_args(split, {item.name for item in piece_items}, example_inputs)
        compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}
        pieces = []
        for index, item in enumerate(piece_items):
            key = structure_key(item.graph, piece_args[item.name])
            if key not in compiled:
                compiled[key] = self._compile(item.graph, piece_args[item.name])
                self.num_piece_compiles += 1
            piece = CompiledPiece(index, len(piece_items), item.name, compiled[key])
            pieces.append(piece)
            # A plain attribute shadows the submodule: the stitching code's `self.submod_<i>(...)`
            # then calls the compiled piece without nn.Module call overhead; `split.named_children()`
            # still lists the traced pieces for printing.
            split.__dict__[item.name] = self.wrap_piece(piece) if self.wrap_piece else piece.runnable
        self.graph, self.split_gm, self.items, self.pieces = graph, split, items, pieces
        logger.info(
            "torch.compile: %d pieces between %d splitting ops, %d distinct pieces compiled with %s in %.2f s",
            len(piece_items),
            len(items) - len(piece_items),
            len(compiled),
            self.piece_compiler,
            time.perf_counter() - start,
        )
        return split

    def _compile(self, piece: fx.GraphModule, example_args: Sequence[Any]) -> Callable[..., Any]:
        if self.piece_compiler == "eager":
            return piece
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(piece, list(example_args))
        # compile_fx returns a path, paths or weights only when compiling ahead of time (AOTInductor).
        assert callable(compiled), f"compile_fx returned a {type(compiled).__name__}, not a callable"
        return compiled


class _ArgRecorder(fx.Interpreter):
    """Runs the split graph on fake tensors and keeps the inputs each piece received."""

    def __init__(self, split: fx.GraphModule, piece_names: set[str]) -> None:
        super().__init__(split)
        self.piece_names = piece_names
        self.args: dict[str, tuple[Any, ...]] = {}

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if target in self.piece_names:
            self.args[target] = args
        return super().call_module(target, args, kwargs)


def _piece_example_args(
    split: fx.GraphModule, piece_names: set[str], example_inputs: Sequence[Any]
) -> dict[str, tuple[Any, ...]]:
    """Each piece's example inputs, as fake tensors whose token dimension is symbolic."""
    fake_mode = detect_fake_mode(example_inputs) or detect_fake_mode()
    if fake_mode is None:
        raise RuntimeError("PiecewiseBackend must be called by torch.compile (no fake tensor mode is active).")
    # from_tensor returns the fake tensor Dynamo made for each input while tracing, so the
    # symbolic token count of input_ids / positions carries into every piece.
    fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    recorder = _ArgRecorder(split, piece_names)
    with fake_mode, enable_python_dispatcher():
        recorder.run(*fake_inputs)
    return recorder.args
