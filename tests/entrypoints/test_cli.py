"""`pagedkv serve` as a user starts it: a subprocess that says where it listens, answers the openai
client, and stops cleanly on Ctrl-C; and, without the `serve` extra, one line saying what to install."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.entrypoints.conftest import MODEL, needs_server_packages

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_serve_answers_and_stops_on_ctrl_c() -> None:
    needs_server_packages()
    import openai

    from pagedkv.entrypoints.openai.api_server import free_port, wait_until_healthy

    port = free_port()
    command = [sys.executable, "-m", "pagedkv", "serve", MODEL, "--port", str(port), "--device", "cpu"]
    command += ["--served-model-name", "pydoc", "--log-level", "warning"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        try:
            wait_until_healthy(f"http://127.0.0.1:{port}", 120, lambda: server.poll() is None)
        except RuntimeError as error:
            raise AssertionError(f"{error} Its stderr: {server.communicate(timeout=30)[1][-2000:]}") from None
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["pydoc"]  # --served-model-name
        response = client.completions.create(model="pydoc", prompt="def f(x):", max_tokens=4, temperature=0)
        assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 4
        server.send_signal(signal.SIGINT)
        stdout, stderr = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    # uvicorn finishes its shutdown, then lets the interrupt go on: the CLI's one line and 130, as for
    # any command stopped with Ctrl-C (128 + SIGINT).
    assert server.returncode == 130, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "pagedkv: interrupted" and "Traceback" not in stderr
    assert f"at http://127.0.0.1:{port}/v1" in stdout  # the line that says where to point the client


def test_serve_without_the_extra_names_it() -> None:
    # fastapi made unimportable (None in sys.modules), as where the `serve` extra is not installed.
    code = "import sys; sys.modules['fastapi'] = None; from pagedkv.__main__ import main; main(['serve', 'tiny'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "pagedkv: error: pagedkv serve needs fastapi, which is not installed: pip install 'pagedkv[serve]'"
    )


@pytest.mark.slow
def test_serve_on_a_taken_port_says_so() -> None:
    needs_server_packages()
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "pagedkv", "serve", MODEL, "--port", str(port), "--device", "cpu"]
        done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 3  # uvicorn's start-up failure
    assert "address already in use" in done.stderr and "Traceback" not in done.stderr
    assert "serving" not in done.stdout  # no line announcing a server that never listened


def test_serve_loads_the_users_code_first(tmp_path) -> None:
    """`pagedkv serve --load FILE` imports FILE before the engine is built (as generate and backends
    do), so a backend it registers can be served; here the file says it ran, then stops the command."""
    plugin = tmp_path / "my_backend.py"
    plugin.write_text("import sys\nprint('plugin loaded')\nsys.exit(7)\n")
    done = subprocess.run(
        [sys.executable, "-m", "pagedkv", "serve", MODEL, "--load", str(plugin)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert done.returncode == 7 and "plugin loaded" in done.stdout, done.stderr[-2000:]
