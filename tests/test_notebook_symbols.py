"""Every pagedkv name a notebook uses or mentions exists.

A notebook that imports `pagedkv.x.y`, reads `K.some_kernel` off a module it imported, or tells
the student in prose to look at `pagedkv.kv_cache.block_pool.hash_block_tokens` or
`pagedkv/worker/cudagraph.py`, makes a promise about the code; a rename breaks the promise
silently (prose never runs, and a code cell only fails in a full run). This test resolves each
name against the installed package, without running any cell:

- code cells (parsed with `ast`): `import pagedkv...`, `from pagedkv... import name`, and every
  attribute chain read off a name such an import bound to a module or a class;
- markdown cells: backticked dotted names `pagedkv.a.b`, backticked imports
  `from pagedkv.a import b`, backticked `Name.attr` where the notebook
  imported `Name` from pagedkv above that cell or `Name` is a class pagedkv defines, backticked paths `pagedkv/a/b.py`, and the code of
  fenced python blocks (the worked solutions) as above.

A failure names the notebook, the cell index and the symbol.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType

import nbformat
import pytest

import pagedkv

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

FENCED_PYTHON = re.compile(r"```python\n(.*?)```", re.DOTALL)
FENCED_ANY = re.compile(r"```.*?```", re.DOTALL)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?<![\w.])pagedkv(?:\.\w+)+")
PATH = re.compile(r"(?<![\w./])pagedkv/[\w./]*")
ATTRIBUTE = re.compile(r"(?<![\w./])([A-Za-z_]\w*)((?:\.\w+)+)")

Namespace = dict[str, object]
"""The names a notebook has bound, so far, to a pagedkv module or class (or other object)."""
_MISSING, _UNCHECKABLE = object(), object()


def resolve_module_path(dotted: str) -> object | None:
    """The object `dotted` names (`pagedkv.a.b.c`: the longest importable module prefix, then
    attributes), or None when some part does not exist."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            found = attribute(obj, name)
            if found is _MISSING:
                return None
            obj = found
            if obj is _UNCHECKABLE:
                return obj
        return obj
    return None


def instance_attributes(cls: type) -> set[str]:
    """Attributes an instance of `cls` has that the class object may not: dataclass fields,
    annotations, and names its methods (any class of its MRO) assign as `self.name`."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass):
            names |= {f.name for f in dataclasses.fields(klass)}
        names |= set(getattr(klass, "__annotations__", {}))
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        names |= set(re.findall(r"\bself\.(\w+)\s*(?::[^=\n]*)?=(?!=)", source))
    return names


def attribute(obj: object, name: str) -> object:
    """`obj.name` for a module or a class (an instance attribute of a class counts, and is not
    followed further); `_UNCHECKABLE` for anything else (a function, an instance: what it holds
    is not known without running the cell); `_MISSING` when a module or class lacks it."""
    if not isinstance(obj, (ModuleType, type)):
        return _UNCHECKABLE
    if hasattr(obj, name):
        return getattr(obj, name)
    if isinstance(obj, ModuleType):
        try:
            return importlib.import_module(f"{obj.__name__}.{name}")
        except ModuleNotFoundError:
            return _MISSING
    return _UNCHECKABLE if name in instance_attributes(obj) else _MISSING


class CodeSymbols(ast.NodeVisitor):
    """Walks one cell's code: checks its pagedkv imports and attribute chains, binds imports into
    `namespace` (a name rebound by the cell in any other way is dropped), notes what is missing."""

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self.missing: list[str] = []
        self.shadowed: list[set[str]] = [set()]

    def bind(self, name: str, obj: object) -> None:
        if len(self.shadowed) == 1:
            self.namespace[name] = obj

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != "pagedkv":
                continue
            obj = resolve_module_path(alias.name)
            if obj is None:
                self.missing.append(alias.name)
            elif alias.asname:
                self.bind(alias.asname, obj)
            else:
                self.bind("pagedkv", importlib.import_module("pagedkv"))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or node.module.split(".")[0] != "pagedkv":
            return
        if resolve_module_path(node.module) is None:
            self.missing.append(node.module)
            return
        for alias in node.names:
            obj = resolve_module_path(f"{node.module}.{alias.name}")
            if obj is None:
                self.missing.append(f"{node.module}.{alias.name}")
            else:
                self.bind(alias.asname or alias.name, obj)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: list[str] = []
        base: ast.expr = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in self.namespace or self.is_shadowed(base.id):
            self.generic_visit(node)
            return
        obj, path = self.namespace[base.id], base.id
        for name in reversed(chain):
            if isinstance(node.ctx, ast.Store) and name == chain[0]:
                break  # assigning a new attribute is not a claim that it exists
            path += f".{name}"
            obj = attribute(obj, name)
            if obj is _MISSING:
                self.missing.append(path)
                break
            if obj is _UNCHECKABLE:
                break
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            if len(self.shadowed) == 1:
                self.namespace.pop(node.id, None)
            else:
                self.shadowed[-1].add(node.id)

    def is_shadowed(self, name: str) -> bool:
        return any(name in scope for scope in self.shadowed)

    def visit_scope(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        args = node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        self.shadowed.append({a.arg for a in params if a is not None})
        self.generic_visit(node)
        self.shadowed.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_scope  # type: ignore[assignment]


def code_symbols(source: str, namespace: Namespace) -> list[str]:
    """The pagedkv names `source` uses that do not exist; binds its imports into `namespace`."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    visitor = CodeSymbols(namespace)
    visitor.visit(ast.parse("\n".join(lines)))
    return visitor.missing


@cache
def package_classes() -> dict[str, type]:
    """Each class pagedkv defines, by name, where the name is unique in the package: prose names
    `KVCacheManager.free` without importing `KVCacheManager` first."""
    found: dict[str, set[type]] = {}
    for info in pkgutil.walk_packages(pagedkv.__path__, "pagedkv."):
        if not info.name.endswith("__main__"):
            for name, obj in vars(importlib.import_module(info.name)).items():
                if isinstance(obj, type) and obj.__module__.startswith("pagedkv") and obj.__name__ == name:
                    found.setdefault(name, set()).add(obj)
    return {name: classes.pop() for name, classes in found.items() if len(classes) == 1}


def markdown_symbols(text: str, namespace: Namespace) -> list[str]:
    """The pagedkv names a markdown cell mentions that do not exist (see the module docstring)."""
    missing = [m for block in FENCED_PYTHON.findall(text) for m in code_symbols(block, dict(namespace))]
    for code in INLINE_CODE.findall(FENCED_ANY.sub("", text)):
        if code.startswith(("from pagedkv", "import pagedkv")):
            missing += code_symbols(code, dict(namespace))  # the names it imports, too
            continue
        missing += [name for name in DOTTED.findall(code) if resolve_module_path(name) is None]
        missing += [path for path in PATH.findall(code) if not (ROOT / path.rstrip(".")).exists()]
        for base, rest in ATTRIBUTE.findall(code):
            known = {**package_classes(), **namespace}
            if base != "pagedkv" and isinstance(known.get(base), (ModuleType, type)):
                missing += code_symbols(f"{base}{rest}", known)
    return missing


def missing_symbols(notebook: Path) -> Iterator[str]:
    """'<notebook> cell <i>: <symbol>' for each pagedkv name the notebook uses or names that does
    not exist, in cell order (imports bind names for the cells below them, as Run All would)."""
    namespace: Namespace = {}
    for i, cell in enumerate(nbformat.read(notebook, as_version=4).cells):
        if cell.cell_type == "code":
            found = code_symbols(cell.source, namespace)
        elif cell.cell_type == "markdown":
            found = markdown_symbols(cell.source, namespace)
        else:
            continue
        yield from (f"{notebook.name} cell {i}: {symbol}" for symbol in found)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_every_pagedkv_name_a_notebook_uses_exists(notebook: Path) -> None:
    assert list(missing_symbols(notebook)) == []


def test_a_made_up_name_is_caught_wherever_it_appears(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import pagedkv.kernels as K\n"
            "from pagedkv.kv_cache.block_pool import BlockPool, no_such_function\n"
            "from pagedkv.no_such_module import x\n"
            "%matplotlib inline\n"
            "K.no_such_kernel(1)\n"
            "BlockPool.no_such_method\n"
            "def f(K):\n    return K.anything  # a parameter, not the module\n"
        ),
        nbformat.v4.new_markdown_cell(
            "See `pagedkv.kv_cache.block_pool.not_there`, `BlockPool.not_there_either` and "
            "`pagedkv/no_such_file.py`; `BlockPool.get_new_blocks` and `pagedkv/kv_cache/` exist; "
            "`KVCacheManager.no_such_method` names a class the notebook never imported; "
            "`from pagedkv.kv_cache.block_pool import BlockPool, gone` imports one that is gone.\n"
            "```python\nfrom pagedkv.exercises import no_such_checker\n```\n"
        ),
    ]
    path = tmp_path / "99_made_up.ipynb"
    nbformat.write(nb, path)
    assert list(missing_symbols(path)) == [
        "99_made_up.ipynb cell 0: pagedkv.kv_cache.block_pool.no_such_function",
        "99_made_up.ipynb cell 0: pagedkv.no_such_module",
        "99_made_up.ipynb cell 0: K.no_such_kernel",
        "99_made_up.ipynb cell 0: BlockPool.no_such_method",
        "99_made_up.ipynb cell 1: pagedkv.exercises.no_such_checker",
        "99_made_up.ipynb cell 1: pagedkv.kv_cache.block_pool.not_there",
        "99_made_up.ipynb cell 1: BlockPool.not_there_either",
        "99_made_up.ipynb cell 1: pagedkv/no_such_file.py",
        "99_made_up.ipynb cell 1: KVCacheManager.no_such_method",
        "99_made_up.ipynb cell 1: pagedkv.kv_cache.block_pool.gone",
    ]
