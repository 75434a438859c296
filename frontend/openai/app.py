"""The OpenAI-compatible HTTP API: one FastAPI app over one `AsyncEngineClient`, assembled from the routers of
`routes/`.

Each HTTP request becomes one engine request per prompt (`GenerateRequest`, with `n` samples), sent to
the frontend over ZeroMQ; the frontend tokenizes, validates and detokenizes (token texts of logprobs
included), so this process holds no tokenizer (the frontend is one process for every client, and keeping
tokenization there keeps one definition of a prompt's tokens; the HTTP process only parses JSON, maps
fields (`params.py`) and writes bodies and chunks (`responses.py`)). Streams are Server-Sent Events as
OpenAI sends them. A client that disconnects has its requests aborted at once (`serving.py`).

In front of every route `guard.py` checks the API key and the body size; `errors.py` answers every failure as
OpenAI's error JSON. Nothing a client sends yields a traceback.
"""

from __future__ import annotations

import os
import re

from fastapi import FastAPI

from frontend.openai.errors import install_error_handlers
from frontend.openai.guard import GuardMiddleware
from frontend.openai.routes import chat, completions, info, profiling, tokenize
from frontend.openai.schema import ErrorResponse
from frontend.openai.serving import ServerState

ROUTERS = (info.router, tokenize.router, completions.router, chat.router, profiling.router)


def build_app(state: ServerState) -> FastAPI:
    """The ASGI application serving `state` (kept as `app.state.server`, where the routes find it).
    `state.client` must be started in the event loop that serves the app."""
    app = FastAPI(title="deltaserve", summary="An OpenAI-compatible API over the deltaserve engine",
                  version=version(), responses={400: {"model": ErrorResponse}})
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state)
    for router in ROUTERS:
        app.include_router(router)
    return app


def version() -> str:
    """deltaserve's version: the installed package's, else that of the checkout's pyproject.toml."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("deltaserve")
    except PackageNotFoundError:  # run from a checkout that was not installed
        pyproject = os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")
        try:
            with open(pyproject, encoding="utf-8") as f:
                found = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
        except OSError:
            found = None
        return found.group(1) if found else "unknown"
