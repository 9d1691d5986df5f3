"""Plugins: a user's module, imported before the engine is built, so that what it registers (an
attention backend, `pagedkv.attention.selector.register_backend`) can be chosen by name.

    pagedkv generate --load my_backend.py --attention-backend MY_BACKEND --prompt "Hello"

In Python a plain `import my_backend` does the same. vLLM loads such code from installed packages'
entry points (vllm/plugins/__init__.py, load_general_plugins); here the command line names the file
or module itself, which needs no packaging.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType


def load_plugin(spec: str) -> ModuleType:
    """Import `spec`: a Python file (`my_backend.py`, any path) or an importable module name
    (`my_package.backends`). Its top-level code runs once, as an import's does.

    A file is imported by its name from its folder, which goes first on `sys.path`: so the module
    has a real name, and the processes of tensor parallelism (which start from this `sys.path`)
    import it again by that name when they receive its backend class."""
    if spec.endswith(".py") or Path(spec).is_file():
        path = Path(spec).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"--load {spec}: no such file (give a Python file or an importable module name).")
        name = path.stem
        loaded = sys.modules.get(name)
        if loaded is not None and Path(getattr(loaded, "__file__", None) or "").resolve() != path:
            raise ValueError(
                f"--load {spec}: a module named {name!r} is already imported from "
                f"{getattr(loaded, '__file__', None) or 'a built-in'}; rename the file."
            )
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        return importlib.import_module(name)
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as error:
        if error.name is None or not (spec == error.name or spec.startswith(error.name + ".")):
            raise  # the module itself imports something missing: that message is the useful one
        raise ValueError(
            f"--load {spec}: no module of that name is importable here (give a Python file such as "
            "my_backend.py, or a module on sys.path)."
        ) from None
