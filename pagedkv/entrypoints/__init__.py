"""Ways in to the engine from outside Python: `pagedkv serve`, an OpenAI-compatible HTTP server.

This layer sits above pagedkv.engine and is the only one that imports the `serve` extra
(FastAPI, uvicorn, prometheus_client): the rest of pagedkv imports without them.
"""
