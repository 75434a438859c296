"""POST /start_profile and /stop_profile (vLLM's routes): the engine's profiling sessions, which trace every
engine process (the engine needs --profile-dir). Both need the API key (`guard.KEYED_ROUTES`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter

from common.protocol import ProfileStatus
from frontend.openai.errors import APIError
from frontend.openai.schema import ProfileResponse, StartProfileRequest
from frontend.openai.serving import ServerState, State

router = APIRouter()


@router.post("/start_profile", response_model=ProfileResponse,
             summary="Trace every engine process from the next step (the engine needs --profile-dir)")
async def start_profile(state: State, req: StartProfileRequest | None = None) -> ProfileResponse:
    """Start a profiling session of `num_steps` engine steps (0: until /stop_profile); a 400 if the engine
    refuses it."""
    num_steps = req.num_steps if req is not None else 0
    return await _profile_request(state, lambda: state.client.start_profile(num_steps))


@router.post("/stop_profile", response_model=ProfileResponse,
             summary="Stop the trace after the last step planned; answers once the files are written and merged")
async def stop_profile(state: State) -> ProfileResponse:
    """Stop the running session; answers once its trace files are written and merged."""
    return await _profile_request(state, state.client.stop_profile)


async def _profile_request(state: ServerState, ask: Callable[[], Awaitable[ProfileStatus]]) -> ProfileResponse:
    """The engine's answer to `ask()` as the response body, asked only once the engine serves (a 503 before);
    a 400 (code profiling_refused) if the engine refuses it."""
    state.engine_info()
    status = await state.ask(ask())
    if status.error is not None:
        raise APIError(400, status.error, code="profiling_refused")
    return ProfileResponse(session=status.session, first_step=status.first_step, last_step=status.last_step,
                           folder=status.folder, summary=status.summary or None)
