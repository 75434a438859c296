"""The OpenAI-compatible HTTP server: `schema.py` (request and response bodies), `params.py` (request ->
SamplingParams), `routes.py` (the FastAPI app), `metrics.py` (/metrics), `server.py` (the process)."""
