"""The OpenAI-compatible server (as vLLM's vllm/entrypoints/openai/): `api_server` builds the FastAPI
app, `protocol` holds the request and response models, `serving_completion` and `serving_chat` turn
requests into engine calls, `metrics` exposes the engine's and the requests' numbers to Prometheus."""
