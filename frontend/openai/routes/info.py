"""GET /health, /version, /v1/models, /v1/models/{model} and /metrics: what the server serves and how it is."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from frontend.openai import metrics
from frontend.openai.errors import unavailable
from frontend.openai.schema import ModelCard, ModelList, VersionResponse
from frontend.openai.serving import State

router = APIRouter()


@router.get("/health", summary="200 once the engine serves; 503 while it starts or goes down")
async def health(state: State) -> Response:
    """200 with an empty body once the engine serves; the 503 error while it starts or goes down."""
    if not state.client.serving:
        return unavailable(state.client.down_reason).response()
    return Response(status_code=200)


@router.get("/version", response_model=VersionResponse)
async def get_version(request: Request) -> VersionResponse:
    """deltaserve's version."""
    return VersionResponse(version=request.app.version)


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: State) -> ModelList:
    """Every served model name, each with the engine's context length (tokens)."""
    info = state.engine_info()
    return ModelList(data=[ModelCard(id=n, root=n, max_model_len=info.max_model_len)
                           for n in info.served_model_names or [info.model]])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, state: State) -> ModelCard:
    """One served model; a 404 for a name not served."""
    state.model_name(model_id)  # a 404 unless served
    return ModelCard(id=model_id, root=model_id, max_model_len=state.engine_info().max_model_len)


@router.get("/metrics", summary="Prometheus metrics (vLLM's names, prefix deltaserve:)")
async def get_metrics(state: State) -> Response:
    """The engine's statistics in Prometheus' text format; a 503 if the engine does not answer."""
    info = state.engine_info()
    stats = await state.ask(state.client.engine_stats())
    body, content_type = metrics.render(stats, info.model)
    return Response(body, media_type=content_type)
