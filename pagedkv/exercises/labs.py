"""Labs: the workbook's exercises as files a course can grade outside Jupyter.

    pagedkv lab list                   every lab: its name, its notebook, what the file must define
    pagedkv lab start NAME [FILE.py]   write a starter: the notebook's skeleton and its exercise text
    pagedkv lab check NAME FILE.py     import FILE.py and run the notebook's own checker on it

A lab is one exercise of a notebook whose answer is code: a function (or, for the Triton puzzles, a
`@triton.jit` kernel and its launcher), or a value the checker can judge on its own (08's lowering
questions and 13's modes: the checker builds the configuration it asks about). `check` builds what the notebook's exercise cell had at hand
(the notebook's engine, for the checkers that take `llm`), then calls the same public checker the
notebook calls, with the names the file defines. Its result is the notebook's line (✓ or ✗, the
broken rule and a hint); a failing check never works the answer out: `reveal()` is a notebook's, after
three tries in one kernel, and a lab is one try.

The starter comes from the notebook itself (the skeleton cell's definitions and the exercise's
text), so a lab cannot drift from the exercise it grades. Not labs: answers read off a state the
notebook builds live and shows (02's blocks and slots, 09's schedules), and notebook 04's backend,
which subclasses NAIVE classes that live only in the notebook.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import json
import re
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from pagedkv.exercises import CheckResult
from pagedkv.workbook import shipped_dirs


@dataclass(frozen=True)
class Lab:
    """One exercise of a notebook as a file: the names the file defines, and the notebook's checker
    that grades them."""

    name: str
    notebook: str
    """The notebook's file name without `.ipynb`, e.g. "01_the_model_file"."""
    defines: tuple[str, ...]
    """What the file must define, named as the notebook's skeleton names them (a copied cell works)."""
    checker: str
    """"module:function" under pagedkv.exercises; imported only to check, and before the student's
    file: a Triton checker's module turns Triton's interpreter on (no GPU) before triton is imported."""
    engine: dict[str, Any] | None = None
    """LLM(**engine) as the notebook builds it, passed to the checker first; None: no engine."""
    imports: tuple[str, ...] = ()
    """Lines the starter needs that the notebook ran in an earlier cell."""
    arguments: Callable[[Sequence[Any]], tuple[Any, ...]] = field(default=tuple, repr=False)
    """The checker's arguments (after the engine) from the defined objects, in `defines` order."""
    value: str | None = None
    """What the one name is set to, for an exercise whose answer is a value; None: functions."""
    shows: Callable[[], str] | None = field(default=None, repr=False)
    """What the notebook prints for the question (the configuration asked about), for the starter."""


def _triton(notebook: str, stem: str, checker: str) -> Lab:
    """A Triton puzzle: `<stem>_kernel` and `<stem>_launch`, checked as (kernel, launch)."""
    return Lab(
        stem.replace("_", "-"),
        notebook,
        (f"{stem}_kernel", f"{stem}_launch"),
        checker,
        imports=("import triton", "import triton.language as tl"),
    )


def _lowering_configuration(number: int) -> Callable[[], str]:
    """What notebook 08 prints for lowering exercise `number`; its module is imported only when a
    starter is written (`lab list` stays quick)."""

    def shows() -> str:
        from pagedkv.exercises.cudagraph import LOWERING_EXERCISES

        return str(LOWERING_EXERCISES[number])

    return shows


def _lowering(number: int) -> Lab:
    """Notebook 08's lowering exercise `number`: what resolve_cudagraph_mode makes of its configuration."""
    return Lab(
        f"lowering-{number}",
        "08_cuda_graphs_and_torch_compile",
        (f"answer_{number}",),
        "pagedkv.exercises.cudagraph:check_lowering",
        arguments=lambda names: (number, *names),
        value='a CUDAGraphMode or its name ("PIECEWISE"), or ValueError if the resolver raises',
        shows=_lowering_configuration(number),
    )


def _spec_mode_cases() -> str:
    """What notebook 13 prints for its mode question: each case's configuration."""
    from pagedkv.exercises.spec_decode import SPEC_MODE_CASES, spec_mode_case

    return "\n".join(
        f"case {case}:\n   " + str(spec_mode_case(case)).replace("\n", "\n   ") for case in SPEC_MODE_CASES
    )


_PUZZLES = "pagedkv.exercises.triton_puzzles"
LABS: dict[str, Lab] = {
    lab.name: lab
    for lab in [
        Lab(
            "choose-backend",
            "00_start_here",
            ("choose_backend",),
            "pagedkv.exercises.environment:check_choose_backend",
            # Notebook 00's engine: device and dtype chosen by LLM (a GPU if there is one).
            engine={"model": "tiny-pydoc", "num_kv_blocks": 256},
        ),
        Lab("qkv-width", "01_the_model_file", ("my_qkv_width",), "pagedkv.exercises.model_file:check_qkv_width"),
        Lab("head-layout", "01_the_model_file", ("my_head_layout",), "pagedkv.exercises.model_file:check_head_layout"),
        Lab(
            "attention-context",
            "03_the_forward_context",
            ("my_attention_context",),
            "pagedkv.exercises.forward_context:check_attention_context",
            # Notebook 03's engine: eager, so its layer hooks see every lookup (a CUDA graph runs no Python).
            engine={"model": "tiny", "num_kv_blocks": 32, "enforce_eager": True, "enable_prefix_caching": False},
            imports=("from pagedkv.forward_context import get_forward_context",),
        ),
        Lab(
            "lengths",
            "05_attention_groups_and_metadata",
            ("lengths",),
            "pagedkv.exercises.attention_groups:check_lengths",
        ),
        Lab(
            "null-blocks",
            "05_attention_groups_and_metadata",
            ("num_null_blocks",),
            "pagedkv.exercises.attention_groups:check_null_blocks",
        ),
        _triton("06_triton_kernels", "block_table_row", f"{_PUZZLES}:check_block_table_row"),
        _triton("06_triton_kernels", "scatter", f"{_PUZZLES}:check_scatter_kernel"),
        _triton("06_triton_kernels", "page_scores", f"{_PUZZLES}:check_page_scores"),
        _triton("06_triton_kernels", "masked_scores", f"{_PUZZLES}:check_masked_scores"),
        _triton("06_triton_kernels", "online_softmax", f"{_PUZZLES}:check_online_softmax"),
        _triton("06_triton_kernels", "gqa", f"{_PUZZLES}:check_gqa_attention"),
        Lab(
            "split-kv",
            "06_triton_kernels",
            ("split_partial_kernel", "split_merge_kernel", "split_kv_launch"),
            f"{_PUZZLES}:check_split_kv",
            imports=("import torch", "import triton", "import triton.language as tl"),
            arguments=lambda names: ((names[0], names[1]), names[2]),  # the checker takes both kernels as a pair
        ),
        Lab(
            "kernel-row",
            "07_flash_attention",
            ("kernel_row",),
            "pagedkv.exercises.flash_attention:check_kernel_block_rows",
        ),
        *(_lowering(number) for number in range(1, 6)),
        Lab(
            "raising",
            "08_cuda_graphs_and_torch_compile",
            ("answer_6",),
            "pagedkv.exercises.cudagraph:check_raising",
            value='a set of (mode, support) pairs of names, such as {("NONE", "ALWAYS")}',
        ),
        Lab(
            "rank-heads",
            "10_tensor_parallelism",
            ("my_rank_heads",),
            "pagedkv.exercises.tensor_parallel:check_rank_heads",
        ),
        Lab(
            "kv-cache-bytes",
            "10_tensor_parallelism",
            ("my_kv_cache_bytes",),
            "pagedkv.exercises.tensor_parallel:check_kv_cache_bytes",
        ),
        Lab(
            "mqa-query",
            "11_mla",
            ("my_mqa_query",),
            "pagedkv.exercises.mla:check_absorbed_query",
            imports=("import torch",),
        ),
        Lab("mla-cache-bytes", "11_mla", ("my_mla_cache_bytes",), "pagedkv.exercises.mla:check_mla_cache_bytes"),
        Lab("decode-split", "11_mla", ("my_split",), "pagedkv.exercises.mla:check_decode_split"),
        Lab("hit-length", "12_prefix_caching", ("my_hit_length",), "pagedkv.exercises.prefix_caching:check_hit_length"),
        Lab("next-block", "12_prefix_caching", ("my_next_block",), "pagedkv.exercises.prefix_caching:check_next_block"),
        Lab("emitted", "13_speculative_decoding", ("my_emitted",), "pagedkv.exercises.spec_decode:check_emitted"),
        Lab(
            "spec-modes",
            "13_speculative_decoding",
            ("my_modes",),
            "pagedkv.exercises.spec_decode:check_spec_modes",
            value='a dict {case: mode} for the cases "a" to "d" (a mode: a CUDAGraphMode, its name, or ValueError)',
            shows=_spec_mode_cases,
        ),
        Lab(
            "rollback-slots",
            "13_speculative_decoding",
            ("my_rollback_slots",),
            "pagedkv.exercises.spec_decode:check_rollback_slots",
        ),
        Lab(
            "num-splits",
            "14_precision_and_determinism",
            ("my_num_splits",),
            "pagedkv.exercises.precision:check_num_splits",
        ),
        Lab(
            "num-blocks",
            "14_precision_and_determinism",
            ("my_num_blocks",),
            "pagedkv.exercises.precision:check_num_blocks",
        ),
        _triton("15_prefill_ladder", "flash_prefill", "pagedkv.exercises.prefill_ladder:check_flash_prefill"),
        Lab("idle-gap", "16_profiling_a_step", ("my_idle_gap",), "pagedkv.exercises.profiling:check_idle_gap"),
    ]
}


class LabFileError(ValueError):
    """A lab's file cannot be graded: it is missing, does not import, or lacks a name the lab needs."""


def find_lab(name: str) -> Lab:
    """The lab called `name`; a ValueError that lists every lab otherwise."""
    if name not in LABS:
        raise ValueError(f"no lab {name!r}; the labs are: {', '.join(LABS)} (pagedkv lab list shows what each needs)")
    return LABS[name]


# ---- the notebook's exercise: its skeleton cell and its text --------------------------------------------


def _cells(notebook: str) -> list[dict[str, Any]]:
    path = shipped_dirs()[0] / f"{notebook}.ipynb"
    try:
        return json.loads(path.read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}: cannot read the notebook's cells ({error})") from None


def _source(cell: dict[str, Any]) -> str:
    return "".join(cell["source"])


@dataclass(frozen=True)
class Exercise:
    """What a lab's notebook shows for it: the exercise's text and its skeleton's definitions."""

    text: str
    """The markdown of the exercise, from its heading ("## Exercise ...", "### Puzzle ...") on."""
    definitions: list[ast.FunctionDef | ast.Assign]
    """The skeleton cell's top-level functions and its assignments of the lab's names, in order."""
    code: str
    """Their source as the cell has it (the skeleton's comments and `...` included)."""


def exercise_of(lab: Lab) -> Exercise:
    """Find `lab`'s exercise in its notebook: the code cell that defines `lab.defines[0]` (a value
    lab's: sets it to `...`), and the nearest markdown cell above it with an exercise or puzzle heading."""
    cells = _cells(lab.notebook)
    first = re.escape(lab.defines[0])
    defining = re.compile(rf"^def {first}\(" if lab.value is None else rf"^{first} = \.\.\.", re.M)
    at = next(
        (i for i, c in enumerate(cells) if c["cell_type"] == "code" and defining.search(_source(c))),
        None,
    )
    if at is None:
        raise ValueError(
            f"notebook {lab.notebook} has no cell that defines {lab.defines[0]}: the lab {lab.name} is stale"
        )
    heading = re.compile(r"^#+ .*(Exercise|Puzzle)", re.M)
    text = next(
        (
            m.string[m.start() :]
            for c in reversed(cells[:at])
            if c["cell_type"] == "markdown"
            if (m := heading.search(_source(c)))
        ),
        "",
    )
    source = _source(cells[at])
    lines = source.splitlines()
    definitions = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) or (isinstance(node, ast.Assign) and defined_name(node) in lab.defines)
    ]

    def lines_of(node: ast.FunctionDef | ast.Assign) -> str:
        """The definition with its decorators (@triton.jit) and the indented lines after its last
        statement: a skeleton's body ends in `# TODO` comments, which are its hints."""
        end = node.end_lineno or node.lineno
        while end < len(lines) and (not lines[end].strip() or lines[end][0].isspace()):
            end += 1
        start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno]) - 1
        return "\n".join(lines[start:end]).rstrip()

    # The cell's other statements (the imports of the checker, `answer = fn`, the check) are the notebook's.
    code = "\n\n\n".join(lines_of(node) for node in definitions)
    # The text's last sentence may introduce the notebook's next cell ("A first try that ...:"), which no lab has.
    text = text.strip()
    if text.endswith(":"):
        text = text[: max(text.rfind(". ") + 1, text.rfind("\n\n"))].rstrip()
    return Exercise(text, definitions, code)


def defined_name(node: ast.FunctionDef | ast.Assign) -> str:
    """The name a skeleton's definition or assignment (`answer_1 = ...`) binds."""
    if isinstance(node, ast.FunctionDef):
        return node.name
    return node.targets[0].id if isinstance(node.targets[0], ast.Name) else ""


def signature(node: ast.FunctionDef) -> str:
    """`name(args) -> returns` as the notebook wrote it; a Triton kernel as its name alone (its many
    pointer and stride arguments are the skeleton's, given in the starter)."""
    if any(ast.unparse(d) == "triton.jit" for d in node.decorator_list):
        return f"{node.name} (a @triton.jit kernel)"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{node.name}({ast.unparse(node.args)}){returns}"


def writes(lab: Lab) -> str:
    """What the file must define, for `lab list`: each function with the notebook's signature, or the
    value its one name is set to."""
    if lab.value is not None:
        return f"{lab.defines[0]} = {lab.value}"
    functions = {
        defined_name(node): node for node in exercise_of(lab).definitions if isinstance(node, ast.FunctionDef)
    }  # a lab without a value defines functions only
    return "; ".join(signature(functions[name]) for name in lab.defines)


def starter(lab: Lab, path: Path) -> str:
    """The starter file of `lab`: the exercise's text as its docstring (with what the notebook
    prints for a question about a configuration), the imports, the skeleton."""
    exercise = exercise_of(lab)
    text = exercise.text
    if lab.shows is not None:
        text += "\n\nThe notebook shows:\n\n" + textwrap.indent(lab.shows(), "    ")
    if lab.value is not None:
        text += f"\n\nSet {lab.defines[0]} to {lab.value}."
    text = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    docstring = (
        f'"""Lab {lab.name}, from notebook {lab.notebook}. Fill in your answer below, then grade it:\n\n'
        f"    pagedkv lab check {lab.name} {path}\n\n"
        "(exit status 0 and a ✓ once it is right; a failing check names the rule your answer broke, with a\n"
        "hint: the notebook's reveal() has no counterpart here). The notebook's exercise:\n\n"
        f'{text}\n"""'
    )
    head = "\n\n".join([docstring, "\n".join(lab.imports)] if lab.imports else [docstring])
    return f"{head}\n\n\n{exercise.code}\n"  # laid out as ruff format would: two blank lines before a def


# ---- grading a file -------------------------------------------------------------------------------------


def _import_file(lab: Lab, path: Path) -> ModuleType:
    """`path` imported as a module of its own; a LabFileError names the file (and the line) otherwise."""
    if not path.exists():
        raise LabFileError(f"{path}: no such file (pagedkv lab start {lab.name} {path} writes a starter)")
    if not path.is_file():
        raise LabFileError(f"{path} is not a file: give the Python file that defines {', '.join(lab.defines)}")
    # Not under "pagedkv.": the Triton checkers refuse a kernel from pagedkv's own modules.
    name = f"pagedkv_lab_{lab.name.replace('-', '_')}"
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None  # None only for a loader without a file name; a SourceFileLoader has one
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered while it runs, as an import does (dataclasses look it up)
    try:
        loader.exec_module(module)
    except SyntaxError as error:  # IndentationError too; in the file, or in a file it imports
        raise LabFileError(
            f"{error.filename or path}, line {error.lineno}: {type(error).__name__}: {error.msg}"
        ) from None
    except (Exception, SystemExit) as error:  # the file's top level may raise anything (or call exit)
        lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == str(path)]
        where = f"{path}, line {lines[-1]}" if lines else str(path)
        raise LabFileError(f"{where}: {type(error).__name__}: {error} (raised while importing the file)") from None
    finally:
        sys.modules.pop(name, None)
    missing = [n for n in lab.defines if not hasattr(module, n)]
    if missing:
        raise LabFileError(f"{path} defines no {' and no '.join(missing)}: the lab {lab.name} grades {writes(lab)}")
    return module


def check_file(lab: Lab, path: Path) -> CheckResult:
    """Grade `path` as the notebook grades its exercise cell: import it, build the notebook's engine
    if the checker takes one, and call the notebook's checker with the names the file defines."""
    module_name, _, function = lab.checker.partition(":")
    checker = getattr(importlib.import_module(module_name), function)  # first: see Lab.checker
    module = _import_file(lab, path)
    arguments = lab.arguments([getattr(module, name) for name in lab.defines])
    if lab.engine is None:
        return checker(*arguments)
    from pagedkv.engine.llm import LLM

    llm = LLM(**lab.engine)
    try:
        return checker(llm, *arguments)
    finally:
        llm.shutdown()
