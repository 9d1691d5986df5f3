"""Every load and store a Triton kernel makes, recorded under Triton's interpreter, checked and drawn.

Triton-Puzzles (and triton-viz) draw which cells of each tensor a kernel's programs read and
write; this module records the same thing itself, so it needs nothing but Triton: with
`TRITON_INTERPRET=1`, every `tl.load` / `tl.store` of a `@triton.jit` kernel goes through the
interpreter's builder (`InterpreterBuilder.create_masked_load` / `create_masked_store`; the
unmasked forms, tensor descriptors and atomic loads and stores call them too) with the lanes'
byte addresses as a numpy array, while the grid loop (`GridExecutor.__call__`) sets the program
id. `record_accesses` wraps those calls for the duration of a `with` block and maps each address
back to a tensor by its address range (`data_ptr()` and strides).

    from pagedkv.exercises.memory_access import record_accesses

    with record_accesses(named={"k_cache": k_cache, "block_table": block_table, "out": out}) as log:
        launch(kernel, block_table, seq_lens, k_cache, out)   # any @triton.jit launches in here

    log.problems(reads=["block_table", "seq_lens", "k_cache"], writes=["out"], rows_written={"out": 1},
                 allowed={"k_cache": used_block_mask}, reasons={"k_cache": "in a block no request owns"})
    # -> [] or one line per broken rule and tensor (the first program that broke it, and how many more), e.g.
    # "copy_rows program 1 (and 2 more programs: 2, 3): loaded 1 element outside every tensor it was given:
    #  1 element past the end of src (src has 8 elements; the furthest is 1 past its last)"
    # "out: 1 of 3 rows never written (out[1]): no program stored to them"

`problems(reads, writes, rows_written=None, allowed=None, reasons=None, races=True, scratch=False)`:
- `reads` / `writes`: names of the tensors loads / stores may touch; any other tensor is a problem,
  and so is an access outside every tensor.
- `rows_written[name]`: every row must be stored in full; an int is the number of leading dimensions
  that index a row (1: out[r]), a tuple the shape of one row (its trailing dimensions).
- `allowed[name]`: the elements that may be touched: flat indices, a bool mask of the tensor's shape,
  or a function of the program id (x, y, z) returning either; `reasons[name]` words the rest.
- `races`: one element stored by two programs of one launch (not atomically) is a problem.
- `scratch`: tensors a kernel was given that are not `named` (a launcher's own workspace) may be
  read and written (by default they count as tensors it may not touch).

`record_accesses(named=None, *, guard=True)`: with `guard`, lanes outside every tensor are recorded
but not run (a load gets its `other` value, a store is dropped). The interpreter reads and writes
the very addresses a kernel computes, so without it a stray store corrupts this process's memory.
An address is matched by where it lies: a lane past the end of one tensor that lands in the next
one in memory counts as that tensor's. A checker gives each tensor a margin (a view of the start
of a larger buffer) so that a stray lane lands outside every tensor.

    from pagedkv.widgets import MemoryAccessView
    MemoryAccessView(log)          # per program id: each tensor's loaded / stored cells

What is recorded (`AccessLog`):
- `log.launches`: one `KernelLaunch` per kernel launch (`kernel` name, `grid` (x, y, z), `args`: kernel
  parameter -> tensor name, `accesses`), in launch order.
- `Access(kind, program, tensor, offsets, inside, atomic, op)`: one memory instruction of one program
  on one tensor: `kind` "load" or "store" (an atomic read-modify-write is both), `program` (x, y, z),
  `offsets` the flat (row-major) element indices it touched, masked-off lanes left out, in lane
  order. An access outside every known tensor has `inside=False`; its `tensor` is then the nearest
  tensor and `offsets` count that tensor's elements from its first one (negative: before it;
  >= numel: past its end). One instruction that touches several tensors gives one Access each.
- `log.tensors`: name -> `TensorInfo` (shape, dtype, ...): the `named` tensors, then every other
  tensor a kernel was given, named after its kernel parameter (e.g. "x_ptr").
- `log.touched(name, kind, program=None, launch=None)`: a bool numpy array of the tensor's shape.
- `log.problems(...)`: plain one-line strings naming the kernel, the program id and the tensor.

On a GPU the interpreter copies tensors to the host and back around a launch; the recorder maps
the copies' addresses back to the device tensors, so `named` may hold CUDA tensors too. A kernel
compiled rather than interpreted (defined before TRITON_INTERPRET=1 was set) cannot be watched:
launching one inside `record_accesses` raises.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

__all__ = [
    "Access",
    "AccessLog",
    "KernelLaunch",
    "TensorInfo",
    "count_text",
    "record_accesses",
    "where_outside",
]

Program = tuple[int, int, int]
Kind = Literal["load", "store"]
Allowed = Collection[int] | np.ndarray | torch.Tensor | Callable[[Program], Any]
"""Elements a kernel may touch: flat indices, or a bool mask of the tensor's shape; or a function
of the program id that returns either."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in memory, and its shape (the recorder keeps no reference to the tensor)."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int
    start: int
    """data_ptr(): the address of element [0, 0, ...]."""

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorInfo:
        return cls(
            name,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            str(tensor.dtype).removeprefix("torch."),
            tensor.element_size(),
            tensor.data_ptr(),
        )

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size > 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def span(self) -> tuple[int, int]:
        """[lowest, highest + itemsize) address of its elements (start, start) when empty."""
        if self.numel == 0:
            return self.start, self.start
        low = sum(min(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        high = sum(max(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        return self.start + low * self.itemsize, self.start + (high + 1) * self.itemsize

    def element_indices(self, addresses: np.ndarray) -> np.ndarray:
        """Flat row-major index of the element at each address; -1 where no element starts there."""
        rel = addresses - self.start
        if self.contiguous:
            index = rel // self.itemsize
            hit = (rel % self.itemsize == 0) & (index >= 0) & (index < self.numel)
            return np.where(hit, index, -1)
        sorted_rel, order = self._layout
        if sorted_rel.size == 0:
            return np.full(addresses.shape, -1, dtype=np.int64)
        pos = np.clip(np.searchsorted(sorted_rel, rel), 0, sorted_rel.size - 1)
        return np.where(sorted_rel[pos] == rel, order[pos], -1)

    @functools.cached_property
    def _layout(self) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets of the elements, sorted, and the flat index of each (strided tensors only)."""
        rel: np.ndarray = np.zeros((), dtype=np.int64)  # a 0-d start: each dimension adds an axis
        for size, stride in zip(self.shape, self.strides):
            rel = rel[..., None] + np.arange(size, dtype=np.int64) * stride * self.itemsize
        rel = rel.reshape(-1)
        order = np.argsort(rel, kind="stable")
        return rel[order], order

    def unravel(self, flat: int) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(flat, self.shape)) if self.shape else ()

    def describe(self, flat: int) -> str:
        """'k_cache[2, 0, 3]' for an element inside the tensor."""
        return f"{self.name}[{', '.join(map(str, self.unravel(flat)))}]"


@dataclass(frozen=True, eq=False)
class Access:
    """One memory instruction (a tl.load or tl.store) of one program, on one tensor."""

    kind: Kind
    program: Program
    tensor: str
    """The tensor touched; for an access outside every tensor, the nearest one."""
    offsets: np.ndarray
    """Flat row-major element indices (int64), masked-off lanes left out; for `inside=False`,
    elements of `tensor` counted from its first one (may be < 0 or >= its numel)."""
    inside: bool = True
    atomic: bool = False
    op: int = 0
    """Which memory instruction of the program this was (0, 1, ...): its place in program order."""

    def __repr__(self) -> str:
        where = "" if self.inside else " OUTSIDE"
        return f"Access({self.kind}{where}, program {self.program}, {self.tensor}, {self.offsets.size} elements)"


@dataclass(eq=False)
class KernelLaunch:
    """One launch of a `@triton.jit` kernel: its grid and every access of its programs."""

    kernel: str
    grid: Program = (1, 1, 1)
    args: dict[str, str] = field(default_factory=dict)
    """Kernel parameter -> name of the tensor passed to it."""
    accesses: list[Access] = field(default_factory=list)

    def programs(self) -> list[Program]:
        """Every program id of the grid, in launch order (x slowest, as the interpreter runs them)."""
        x, y, z = self.grid
        return list(itertools.product(range(x), range(y), range(z)))

    def of(self, program: Program) -> list[Access]:
        """The accesses of one program, in program order."""
        return [a for a in self.accesses if a.program == program]

    @property
    def dims(self) -> int:
        """How many grid dimensions the launch used: its trailing 1s dropped, at least one."""
        return max((i + 1 for i, n in enumerate(self.grid) if n > 1), default=1)

    def program_id(self, program: Program) -> str:
        """'3' on a 1-D grid, '(3, 1)' on a 2-D one: the id as the kernel's tl.program_id calls see it."""
        return str(program[0]) if self.dims == 1 else str(tuple(program[: self.dims]))

    def program_text(self, program: Program) -> str:
        return f"program {self.program_id(program)}"

    def __repr__(self) -> str:
        return f"KernelLaunch({self.kernel}, grid {self.grid}, {len(self.accesses)} accesses)"


class AccessLog:
    """What the kernels launched inside one `record_accesses` block loaded and stored."""

    def __init__(self, named: Mapping[str, torch.Tensor]) -> None:
        self.tensors: dict[str, TensorInfo] = {name: TensorInfo.of(name, t) for name, t in named.items()}
        self.named: tuple[str, ...] = tuple(named)
        self.launches: list[KernelLaunch] = []

    def __repr__(self) -> str:
        return f"AccessLog({len(self.launches)} launches, tensors {', '.join(self.tensors)})"

    def accesses(
        self,
        kind: Kind | None = None,
        tensor: str | None = None,
        program: Program | None = None,
        launch: int | None = None,
    ) -> Iterator[tuple[KernelLaunch, Access]]:
        """Each access that matches every given filter, with its launch (`launch`: index into launches)."""
        launches = self.launches if launch is None else [self.launches[launch]]
        for run in launches:
            for a in run.accesses:
                if kind in (None, a.kind) and tensor in (None, a.tensor) and program in (None, a.program):
                    yield run, a

    def touched(self, name: str, kind: Kind, program: Program | None = None, launch: int | None = None) -> np.ndarray:
        """A bool array of `name`'s shape: the elements loaded (or stored) inside it."""
        info = self.tensors[name]
        hit = np.zeros(info.numel, dtype=bool)
        for _, a in self.accesses(kind, name, program, launch):
            if a.inside:
                hit[a.offsets] = True
        return hit.reshape(info.shape)

    def problems(
        self,
        reads: Iterable[str] = (),
        writes: Iterable[str] = (),
        rows_written: Mapping[str, int | tuple[int, ...]] | None = None,
        allowed: Mapping[str, Allowed] | None = None,
        reasons: Mapping[str, str] | None = None,
        races: bool = True,
        scratch: bool = False,
    ) -> list[str]:
        """One line per broken rule: an access outside every tensor, a load of a tensor not in `reads`
        (a store not in `writes`), an element outside `allowed[name]`, a row of `rows_written` not
        (fully) written, and (`races`) one element stored by two programs of one launch.

        `rows_written[name]` says what a row is: an int, the number of leading dimensions that index
        a row (1: out[r] is a row), or a tuple, the shape of one row (its trailing dimensions).
        `reasons[name]` words what lies outside `allowed[name]` ("in a block no request owns").
        `scratch`: the tensors a kernel was given that are not in `named` (a launcher's own
        workspace) may be read and written too. An empty list means no problem; loads and stores are
        checked per program, in grid order.
        """
        if not self.launches:
            return ["no @triton.jit kernel ran inside record_accesses: nothing was loaded or stored"]
        reads, writes, allowed, reasons = set(reads), set(writes), dict(allowed or {}), dict(reasons or {})
        if scratch:
            own = {name for name in self.tensors if name not in self.named}
            reads, writes = reads | own, writes | own
        for name in [*reads, *writes, *allowed, *(rows_written or {})]:
            if name not in self.tensors:
                raise KeyError(
                    f"problems() names {name!r}, which record_accesses was not given: "
                    f"known tensors are {', '.join(self.tensors)}"
                )
        found: list[str] = []
        for run in self.launches:
            # one line per broken rule and tensor: the first program that broke it, and how many more did
            broken: dict[tuple[str, ...], list[tuple[Program, str]]] = {}
            by_program: dict[Program, list[Access]] = {}
            for a in run.accesses:
                by_program.setdefault(a.program, []).append(a)
            for program in sorted(by_program):  # grid order: x slowest, as the interpreter runs them
                found_here = self._program_problems(by_program[program], program, reads, writes, allowed, reasons)
                for key, detail in found_here:
                    broken.setdefault(key, []).append((program, detail))
            for cases in broken.values():
                (program, detail), others = cases[0], [p for p, _ in cases[1:]]
                more = ""
                if others:
                    listed = ", ".join(run.program_id(p) for p in others[:4]) + (", ..." if len(others) > 4 else "")
                    more = f" (and {len(others)} more program{'s' if len(others) > 1 else ''}: {listed})"
                found.append(f"{run.kernel} {run.program_text(program)}{more}: {detail}")
            if races:
                found += self._races(run)
        for name, row in (rows_written or {}).items():
            found += self._unwritten_rows(name, row)
        return found

    def _program_problems(
        self,
        accesses: list[Access],
        program: Program,
        reads: set[str],
        writes: set[str],
        allowed: dict[str, Allowed],
        reasons: dict[str, str],
    ) -> list[tuple[tuple[str, ...], str]]:
        """(rule broken, what the program did) for each rule one program's `accesses` broke."""
        found = []
        groups: dict[tuple[Kind, str, bool], list[np.ndarray]] = {}
        for a in accesses:
            groups.setdefault((a.kind, a.tensor, a.inside), []).append(a.offsets)
        for (kind, name, inside), parts in groups.items():
            offsets = np.unique(np.concatenate(parts))
            info = self.tensors[name]
            verb = "loaded" if kind == "load" else "stored"
            if not inside:
                outside = _outside_parts(info, offsets)
                found.append(
                    (
                        ("outside", kind, name, *(where for where, _ in outside)),
                        f"{verb} {count_text(offsets.size)} outside every tensor it was given: "
                        f"{'; '.join(text for _, text in outside)}",
                    )
                )
                continue
            permitted = reads if kind == "load" else writes
            if name not in permitted:
                access = "read" if kind == "load" else "write"
                may = f"it may {access} {', '.join(sorted(permitted))}" if permitted else f"it may {access} no tensor"
                found.append(
                    (
                        ("not permitted", kind, name),
                        f"{verb} {count_text(offsets.size)} of {name} (first "
                        f"{info.describe(offsets[0])}), which it may not {access} ({may})",
                    )
                )
                continue
            if name in allowed:
                ok = _allowed_mask(allowed[name], program, info)
                bad = offsets[~ok[offsets]]
                if bad.size:
                    why = reasons.get(name, "outside the part it may touch")
                    found.append(
                        (
                            ("not allowed", kind, name),
                            f"{verb} {count_text(bad.size)} of {name} {why} (first {info.describe(bad[0])})",
                        )
                    )
        return found

    def _races(self, run: KernelLaunch) -> list[str]:
        """Elements stored by two programs of one launch: on a GPU they run at once, in no set order."""
        found = []
        for name in self.tensors:
            owner: dict[int, Program] = {}
            for a in run.accesses:
                if a.kind != "store" or a.tensor != name or not a.inside or a.atomic:
                    continue
                for flat in np.unique(a.offsets).tolist():
                    first = owner.setdefault(flat, a.program)
                    if first != a.program:
                        found.append(
                            f"{run.kernel}: {self.tensors[name].describe(flat)} stored by "
                            f"{run.program_text(first)} and {run.program_text(a.program)} (programs "
                            f"run in parallel on a GPU: which store lands last is not defined)"
                        )
                        break
                else:
                    continue
                break
        return found

    def _unwritten_rows(self, name: str, row: int | tuple[int, ...]) -> list[str]:
        info = self.tensors[name]
        lead = row if isinstance(row, int) else len(info.shape) - len(row)
        if not 0 <= lead <= len(info.shape) or (not isinstance(row, int) and tuple(info.shape[lead:]) != tuple(row)):
            raise ValueError(
                f"rows_written[{name!r}] = {row!r} does not fit {name}'s shape {info.shape}: give the "
                "number of leading dimensions that index a row, or the shape of one row"
            )
        written = self.touched(name, "store").reshape(int(np.prod(info.shape[:lead], dtype=np.int64)), -1)
        never = np.flatnonzero(~written.any(axis=1))
        partly = np.flatnonzero(written.any(axis=1) & ~written.all(axis=1))
        rows = np.unravel_index(np.arange(written.shape[0]), info.shape[:lead]) if lead else ()

        def row_text(i: int) -> str:
            return f"{name}[{', '.join(str(int(r[i])) for r in rows)}]"

        found = []
        if never.size:
            listed = ", ".join(row_text(i) for i in never[:4]) + (", ..." if never.size > 4 else "")
            found.append(
                f"{name}: {never.size} of {written.shape[0]} rows never written ({listed}): no program stored to them"
            )
        if partly.size:
            first = int(partly[0]) * written.shape[1] + int(np.flatnonzero(~written[partly[0]])[0])
            found.append(
                f"{name}: {partly.size} of {written.shape[0]} rows only partly written "
                f"(first unwritten element {info.describe(first)})"
            )
        return found


def count_text(n: int) -> str:
    """'1 element', '4 elements'."""
    return f"{n} element" + ("" if n == 1 else "s")


def where_outside(info: TensorInfo, offsets: np.ndarray) -> str:
    """Where an outside Access's offsets lie: past the end of `info`, before its start, or in a gap
    between its elements (a strided view: past the end of one of its rows, say)."""
    return "; ".join(text for _, text in _outside_parts(info, offsets))


def _outside_parts(info: TensorInfo, offsets: np.ndarray) -> list[tuple[str, str]]:
    """(where: "past" / "before" / "gaps", text) for each kind of place the offsets lie in."""
    low, high = ((edge - info.start) // info.itemsize for edge in info.span)
    past, before = offsets[offsets >= high], offsets[offsets < low]
    between = offsets[(offsets >= low) & (offsets < high)]
    parts = []
    if past.size:
        parts.append(
            (
                "past",
                f"{count_text(past.size)} past the end of {info.name} ({info.name} has {info.numel} "
                f"elements; the furthest is {int(past.max()) - high + 1} past its last)",
            )
        )
    if before.size:
        parts.append(
            (
                "before",
                f"{count_text(before.size)} before the start of {info.name} (up to {low - int(before.min())} before)",
            )
        )
    if between.size:
        sorted_rel, order = info._layout
        first = int(between.min())
        previous = int(order[np.searchsorted(sorted_rel, first * info.itemsize, side="right") - 1])
        parts.append(
            (
                "gaps",
                f"{count_text(between.size)} in the gaps between the elements of {info.name} (the "
                f"first just after {info.describe(previous)})",
            )
        )
    return parts


def _allowed_mask(what: Allowed, program: Program, info: TensorInfo) -> np.ndarray:
    """`allowed[name]` as a flat bool mask over the tensor's elements."""
    if callable(what) and not isinstance(what, (np.ndarray, torch.Tensor)):
        what = what(program)
    if isinstance(what, torch.Tensor):
        what = what.detach().cpu().numpy()
    array = np.asarray(what if not isinstance(what, (set, frozenset)) else sorted(what))
    if array.dtype == bool:
        if array.size != info.numel:
            raise ValueError(f"allowed[{info.name!r}] is a mask of {array.size} elements; {info.name} has {info.numel}")
        return array.reshape(-1)
    mask = np.zeros(info.numel, dtype=bool)
    mask[array.astype(np.int64).reshape(-1)] = True
    return mask


class _Recorder:
    """The patched interpreter calls' side: resolves addresses of the current launch into Accesses."""

    def __init__(self, log: AccessLog) -> None:
        self.log = log
        self.run: KernelLaunch | None = None
        self.moved: list[tuple[int, int, int]] = []
        """(host start, host end, device - host) of each argument the interpreter copied to the host."""
        self.order: list[TensorInfo] = []
        """Tensors in the order an address is matched: the named ones, this launch's arguments, older ones."""
        self.ops: dict[Program, int] = {}

    def start_launch(self, executor: Any, args_dev: tuple, kwargs: dict, args_hst: list, kwargs_hst: dict) -> None:
        run = KernelLaunch(getattr(executor.fn, "__name__", "kernel"))
        self.moved, fresh = [], list[TensorInfo]()
        pairs = [*zip(executor.arg_names, args_dev, args_hst), *((k, kwargs[k], kwargs_hst[k]) for k in kwargs)]
        for param, dev, hst in pairs:
            for dev_t, hst_t in _tensor_pairs(dev, hst):
                info = TensorInfo.of(param, dev_t)
                host_storage, dev_storage = hst_t.untyped_storage(), dev_t.untyped_storage()
                if host_storage.data_ptr() != dev_storage.data_ptr():
                    low = host_storage.data_ptr()
                    self.moved.append((low, low + host_storage.nbytes(), dev_storage.data_ptr() - low))
                run.args[param] = self._register(info, fresh)
        named = [self.log.tensors[n] for n in self.log.named]
        older = [t for t in self.log.tensors.values() if t.name not in self.log.named and t not in fresh]
        self.order = named + fresh + older
        self.ops = {}
        self.run = run
        self.log.launches.append(run)

    def _register(self, info: TensorInfo, fresh: list[TensorInfo]) -> str:
        """The name of the tensor a kernel argument is: a named tensor it lies in, or a new entry."""
        low, high = info.span
        for name in self.log.named:
            named_low, named_high = self.log.tensors[name].span
            if named_low <= low and high <= named_high:
                return name
        for known in self.log.tensors.values():
            if (known.start, known.shape, known.strides, known.dtype) == (
                info.start,
                info.shape,
                info.strides,
                info.dtype,
            ):
                fresh.append(known)
                return known.name
        name = info.name
        for k in itertools.count(2):
            if name not in self.log.tensors:
                break
            name = f"{info.name}#{k}"
        info = TensorInfo(name, info.shape, info.strides, info.dtype, info.itemsize, info.start)
        self.log.tensors[name] = info
        fresh.append(info)
        return name

    def record(
        self, kind: Kind, ptrs: np.ndarray, mask: np.ndarray | None, program: Program, atomic: bool
    ) -> np.ndarray | None:
        """Record one instruction's active lanes; returns which lanes hit a tensor (None outside a launch)."""
        if self.run is None:  # a device function called outside a launch: nothing to attribute it to
            return None
        lanes = np.asarray(ptrs)
        active = np.broadcast_to(np.asarray(True if mask is None else mask, dtype=bool), lanes.shape)
        addresses = self._to_device(lanes[active].astype(np.uint64).astype(np.int64))
        op = self.ops.get(program, 0)
        self.ops[program] = op + 1
        left = np.ones(addresses.size, dtype=bool)
        for info in self.order:
            if not left.any():
                break
            index = info.element_indices(addresses)
            hit = left & (index >= 0)
            if hit.any():
                self.run.accesses.append(Access(kind, program, info.name, index[hit], True, atomic, op))
                left &= ~hit
        if left.any():
            self._record_outside(kind, program, addresses[left], atomic, op)
        inside = active.copy()
        inside[active] = ~left
        return inside

    def _record_outside(self, kind: Kind, program: Program, addresses: np.ndarray, atomic: bool, op: int) -> None:
        """Addresses in no tensor: one Access per nearest tensor, offsets counted in its elements."""
        assert self.run is not None, "record() returns before this outside a launch"
        if not self.order:
            self.run.accesses.append(Access(kind, program, "", addresses, False, atomic, op))
            return
        distance = np.stack(
            [np.maximum(np.maximum(t.span[0] - addresses, addresses - (t.span[1] - 1)), 0) for t in self.order]
        )
        nearest = distance.argmin(axis=0)
        for i in np.unique(nearest).tolist():
            info = self.order[i]
            offsets = (addresses[nearest == i] - info.start) // info.itemsize
            self.run.accesses.append(Access(kind, program, info.name, offsets, False, atomic, op))

    def _to_device(self, addresses: np.ndarray) -> np.ndarray:
        """Host addresses of the interpreter's copies -> the device tensors' addresses (the nearest
        copy's shift for an address in no copy, so "3 past the end" still reads as such)."""
        if not self.moved:
            return addresses
        lows = np.array([m[0] for m in self.moved], dtype=np.int64)
        highs = np.array([m[1] for m in self.moved], dtype=np.int64)
        shifts = np.array([m[2] for m in self.moved], dtype=np.int64)
        distance = np.maximum(np.maximum(lows[:, None] - addresses, addresses - (highs[:, None] - 1)), 0)
        return addresses + shifts[distance.argmin(axis=0)]


def _tensor_pairs(dev: Any, hst: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(device tensor, its host copy) for a kernel argument: a tensor, a tuple of them, a descriptor's base."""
    if isinstance(dev, tuple):
        for d, h in zip(dev, hst):
            yield from _tensor_pairs(d, h)
    elif hasattr(dev, "base") and hasattr(dev, "block_shape"):  # a TensorDescriptor
        yield from _tensor_pairs(dev.base, hst.base)
    elif hasattr(dev, "data_ptr"):

        def unwrap(t: Any) -> torch.Tensor:  # triton.reinterpret's TensorWrapper -> its tensor
            return t if isinstance(t, torch.Tensor) else getattr(t, "base", t)

        yield unwrap(dev), unwrap(hst)


@contextmanager
def record_accesses(named: Mapping[str, torch.Tensor] | None = None, *, guard: bool = True) -> Iterator[AccessLog]:
    """Record every load and store of the `@triton.jit` kernels launched inside the block.

    `named`: name -> tensor; an address is matched to these first (a view passed to a kernel counts
    as the named tensor it lies in), then to the other tensors the kernels were given (named after
    their parameter). `guard`: lanes outside every tensor are recorded but not performed (a load
    gets its `other` value, a store is dropped): the interpreter really reads and writes the
    addresses a kernel computes, so a stray store would corrupt this process's memory. Needs
    TRITON_INTERPRET=1 before the kernels were defined. The interpreter is restored when the block
    ends, however it ends (an exception, KeyboardInterrupt).
    """
    from pagedkv.kernels.common import INTERPRETER_HINT, interpreting

    if not interpreting():  # (pagedkv's interpreter_problem also probes what its own kernels need: not asked here)
        raise RuntimeError(f"record_accesses watches Triton's interpreter, which is off: {INTERPRETER_HINT}")
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    log = AccessLog(named or {})
    recorder = _Recorder(log)
    builder_cls, executor_cls = interpreter.InterpreterBuilder, interpreter.GridExecutor
    saved = {
        (builder_cls, "create_masked_load"): builder_cls.create_masked_load,
        (builder_cls, "create_masked_store"): builder_cls.create_masked_store,
        (builder_cls, "create_atomic_rmw"): builder_cls.create_atomic_rmw,
        (builder_cls, "create_atomic_cas"): builder_cls.create_atomic_cas,
        (executor_cls, "_init_args_hst"): executor_cls._init_args_hst,
        (JITFunction, "run"): JITFunction.run,
    }
    load, store = builder_cls.create_masked_load, builder_cls.create_masked_store
    rmw, cas, init_args = builder_cls.create_atomic_rmw, builder_cls.create_atomic_cas, executor_cls._init_args_hst

    def guarded(mask: Any, inside: np.ndarray | None) -> Any:
        """`mask` with the lanes outside every tensor turned off (`guard`), so they are not performed."""
        return mask if not guard or inside is None else interpreter.TensorHandle(inside, mask.dtype)

    def masked_load(self: Any, ptrs: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        inside = recorder.record("load", ptrs.data, mask.data, self.grid_idx, atomic=False)
        return load(self, ptrs, guarded(mask, inside), *args, **kwargs)

    def masked_store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        inside = recorder.record("store", ptrs.data, mask.data, self.grid_idx, atomic=False)
        return store(self, ptrs, value, guarded(mask, inside), *args, **kwargs)

    def atomic_rmw(self: Any, op: Any, ptr: Any, val: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.record("load", ptr.data, mask.data, self.grid_idx, atomic=True)
        inside = recorder.record("store", ptr.data, mask.data, self.grid_idx, atomic=True)
        return rmw(self, op, ptr, val, guarded(mask, inside), *args, **kwargs)

    def atomic_cas(self: Any, ptr: Any, *args: Any, **kwargs: Any) -> Any:  # no mask to guard it with
        for kind in ("load", "store"):
            recorder.record(kind, ptr.data, None, self.grid_idx, atomic=True)
        return cas(self, ptr, *args, **kwargs)

    def init_args_hst(self: Any, args_dev: tuple, kwargs: dict) -> Any:
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        recorder.start_launch(self, args_dev, kwargs, args_hst, kwargs_hst)
        return args_hst, kwargs_hst

    def compiled_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"kernel {getattr(self, '__name__', self)!r} is compiled, not interpreted (it was defined before "
            "TRITON_INTERPRET=1 was set), so record_accesses cannot see its loads and stores: set "
            "TRITON_INTERPRET=1 first, then define the kernel"
        )

    def grid_dim(self: Any, nx: int, ny: int, nz: int) -> None:
        if recorder.run is not None:
            recorder.run.grid = (nx, ny, nz)
        set_grid_dim(self, nx, ny, nz)

    set_grid_dim = builder_cls.set_grid_dim
    saved[(builder_cls, "set_grid_dim")] = set_grid_dim
    patches = {
        (builder_cls, "create_masked_load"): masked_load,
        (builder_cls, "create_masked_store"): masked_store,
        (builder_cls, "create_atomic_rmw"): atomic_rmw,
        (builder_cls, "create_atomic_cas"): atomic_cas,
        (builder_cls, "set_grid_dim"): grid_dim,
        (executor_cls, "_init_args_hst"): init_args_hst,
        (JITFunction, "run"): compiled_run,
    }
    try:
        for (owner, name), patch in patches.items():
            setattr(owner, name, patch)
        yield log
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)
        recorder.run = None
