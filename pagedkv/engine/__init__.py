"""The engine: requests, the scheduler, the sampler and the LLM front end."""
