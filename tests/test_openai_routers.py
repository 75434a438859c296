"""A router of `frontend/openai/routes/` mounted alone on a bare FastAPI app over a stub engine client: the routes
need only `app.state.server`, so they are tested here without an engine, and two apps serve side by side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from common.protocol import DetokenizeResult, EngineInfo, GenerateRequest, TokenizeResult
from frontend.openai.errors import install_error_handlers
from frontend.openai.routes import info, tokenize
from frontend.openai.serving import ServerState


@dataclass
class StubClient:
    """The part of `AsyncEngineClient` the tokenize and info routes use: a "tokenizer" of one id per character
    (its code point) that refuses ids past `vocab_size`."""

    info: EngineInfo | None
    down_reason: str | None = None
    asked: list[GenerateRequest] = field(default_factory=list)

    @property
    def serving(self) -> bool:
        return self.info is not None and self.down_reason is None

    async def tokenize(self, request: GenerateRequest) -> TokenizeResult:
        self.asked.append(request)
        if request.prompt == "":
            return TokenizeResult(0, error="the prompt is empty")
        text = request.prompt if request.prompt is not None else "|".join(m["content"] for m in request.messages)
        return TokenizeResult(0, token_ids=[ord(c) for c in text])

    async def detokenize(self, token_ids: list[int]) -> DetokenizeResult:
        assert self.info is not None
        if any(t >= self.info.vocab_size for t in token_ids):
            return DetokenizeResult(0, error=f"token ids must be in [0, {self.info.vocab_size})")
        return DetokenizeResult(0, text="".join(chr(t) for t in token_ids))


def engine_info(name: str, max_model_len: int = 64) -> EngineInfo:
    return EngineInfo(model=f"/models/{name}", max_model_len=max_model_len, num_kv_blocks=8, block_size=16,
                      vocab_size=200, served_model_names=[name, f"{name}-alias"])


def bare_app(client: Any, *routers: Any) -> FastAPI:
    """A FastAPI app with only `routers`, the error handlers and `client`'s state: no guard, no other route."""
    app = FastAPI()
    app.state.server = ServerState(client)
    install_error_handlers(app)
    for router in routers:
        app.include_router(router)
    return app


def test_tokenize_router_alone_maps_a_prompt_to_the_engines_tokens() -> None:
    client = StubClient(engine_info("tiny", max_model_len=64))
    http = TestClient(bare_app(client, tokenize.router))
    r = http.post("/tokenize", json={"prompt": "Hi!", "add_special_tokens": False, "model": "tiny-alias"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 3, "max_model_len": 64, "tokens": [72, 105, 33]}
    (asked,) = client.asked
    assert (asked.prompt, asked.messages, asked.add_special_tokens) == ("Hi!", None, False)

    r = http.post("/tokenize", json={"messages": [{"role": "developer", "content": "be brief"},
                                                  {"role": "user", "content": "ok"}]})
    assert r.status_code == 200 and r.json()["tokens"] == [ord(c) for c in "be brief|ok"]
    assert client.asked[-1].messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ok"}]

    r = http.post("/detokenize", json={"tokens": [111, 107]})
    assert r.status_code == 200 and r.json() == {"prompt": "ok"}


def test_tokenize_router_alone_answers_openais_errors() -> None:
    http = TestClient(bare_app(StubClient(engine_info("tiny")), tokenize.router))
    r = http.post("/tokenize", json={"prompt": ""})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "the prompt is empty", "type": "invalid_request_error",
                                  "param": "prompt", "code": None}}
    r = http.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "give exactly one of prompt and messages"
    r = http.post("/detokenize", json={"tokens": [5, 300]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert r.json()["error"]["message"] == "token ids must be in [0, 200)"
    r = http.post("/detokenize", json={"tokens": [5], "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/tokenize", json={"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert http.get("/health").status_code == 404  # the info router is not mounted


def test_two_apps_in_one_process_serve_their_own_state() -> None:
    starting = StubClient(None)
    tiny = TestClient(bare_app(StubClient(engine_info("tiny", max_model_len=64)), info.router))
    large = TestClient(bare_app(StubClient(engine_info("large", max_model_len=4096)), info.router))
    down = TestClient(bare_app(starting, info.router))

    assert tiny.get("/health").status_code == 200 and large.get("/health").status_code == 200
    assert [(m["id"], m["max_model_len"]) for m in tiny.get("/v1/models").json()["data"]] == [
        ("tiny", 64), ("tiny-alias", 64)]
    assert large.get("/v1/models/large-alias").json()["max_model_len"] == 4096
    assert tiny.get("/v1/models/large").status_code == 404

    r = down.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert r.json()["error"]["message"] == "the engine is starting: try again in a moment"
    starting.info, starting.down_reason = engine_info("tiny"), "the engine is shutting down"
    r = down.get("/v1/models")
    assert r.status_code == 503 and r.json()["error"]["message"] == "the engine is shutting down"
