"""A `pagedkv serve` of tiny-pydoc for the tests: uvicorn in a thread of the test process, on a free
loopback port, and an offline `LLM` of the same model to compare its answers with.

Each test module skips itself (`needs_server_packages`) where the `serve` extra or the openai client is
missing; this file imports them only inside the fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pagedkv import LLM
from pagedkv.engine.async_llm import AsyncLLM

MODEL = "tiny-pydoc"
ENGINE_ARGS = {"device": "cpu", "max_num_seqs": 64}
"""The server's engine and the reference LLM are built alike: the same tokens for the same request."""


SERVER_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "jinja2", "httpx", "openai")


def needs_server_packages() -> None:
    """Skip the calling test module unless the server's packages and the openai client are installed."""
    for module in SERVER_PACKAGES:
        pytest.importorskip(module, reason=f"the server tests need {module} (pip install 'pagedkv[serve]' openai)")


@dataclass
class Server:
    base_url: str
    """http://127.0.0.1:PORT (the openai client's base_url is this + /v1)."""
    engine: AsyncLLM

    def metric(self, name: str) -> float:
        """The value of `pagedkv:<name>` (its one sample) in GET /metrics."""
        import httpx

        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(f"pagedkv:{name}{{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"pagedkv:{name} is not in /metrics")


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    from pagedkv.entrypoints.openai.api_server import BackgroundServer

    engine = AsyncLLM(MODEL, **ENGINE_ARGS)
    with BackgroundServer(engine) as background:
        yield Server(background.url, engine)
    engine.shutdown()


@pytest.fixture(scope="session")
def llm() -> Iterator[LLM]:
    """The offline engine the server's answers are compared with."""
    with LLM(MODEL, **ENGINE_ARGS) as offline:
        yield offline
