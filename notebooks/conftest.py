"""nbval over the workbook: notebooks that need a GPU are skipped, centrally, when none is visible.

A notebook says so in its metadata:  {"pagedkv": {"requires_gpu": true}}
(JupyterLab: Property Inspector -> Advanced Tools -> Notebook metadata).
"""

from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    for item in items:
        notebook = getattr(item.parent, "nb", None)  # nbval's IPyNbFile keeps the parsed notebook here
        if notebook is None:
            continue
        if notebook.metadata.get("pagedkv", {}).get("requires_gpu", False):
            item.add_marker(pytest.mark.skip(
                reason=f"{item.parent.name} needs a CUDA GPU (metadata pagedkv.requires_gpu) and none is visible"
            ))
