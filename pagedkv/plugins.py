"""Plugins: a user's module, imported before the engine is built, so that what it registers (an
attention backend, `pagedkv.attention.selector.register_backend`) can be chosen by name.

    pagedkv generate --load my_backend.py --attention-backend MY_BACKEND --prompt "Hello"

In Python a plain `import my_backend` does the same. vLLM loads such code from installed packages'
entry points (vllm/plugins/__init__.py, load_general_plugins); here the command line names the file
or module itself, which needs no packaging.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_plugin(spec: str) -> ModuleType:
    """Import `spec`: a Python file (`my_backend.py`, any path) or an importable module name
    (`my_package.backends`). Its top-level code runs once, as an import's does."""
    if spec.endswith(".py") or Path(spec).is_file():
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"--load {spec}: no such file (give a Python file or an importable module name).")
        name = path.stem
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path.resolve()):
            return sys.modules[name]  # loaded already: running it again would register everything twice
        module_spec = importlib.util.spec_from_file_location(name, path.resolve())
        assert module_spec is not None and module_spec.loader is not None  # a .py file always has one
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # as an import does (dataclasses and pickling look the module up by name)
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as error:
        if error.name is None or not (spec == error.name or spec.startswith(error.name + ".")):
            raise  # the module itself imports something missing: that message is the useful one
        raise ValueError(
            f"--load {spec}: no module of that name is importable here (give a Python file such as "
            "my_backend.py, or a module on sys.path)."
        ) from None
