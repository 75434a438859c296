"""The OpenAI-compatible HTTP server: `schema.py` (request and response bodies), `params.py` (request ->
SamplingParams), `app.py` (the FastAPI app, assembled from the routers of `routes/`), `serving.py` (a route's
way to the engine and back), `responses.py` (bodies and stream chunks), `errors.py` (OpenAI's error JSON),
`guard.py` (API key and body size), `metrics.py` (/metrics), `server.py` (the process)."""
