"""The HTTP routes, one `fastapi.APIRouter` per concern (`app.py` includes them all):

- `info.py`: GET /health, /version, /v1/models, /v1/models/{model}, /metrics
- `tokenize.py`: POST /tokenize, /detokenize
- `completions.py`: POST /v1/completions
- `chat.py`: POST /v1/chat/completions
- `profiling.py`: POST /start_profile, /stop_profile (vLLM's routes)

Each route takes its `ServerState` as the dependency `serving.State`, so a router can be mounted alone on any
FastAPI app whose `app.state.server` is set.
"""
