"""The HTTP application: routes, the API key check, errors in OpenAI's shape.

Besides the OpenAI routes, /tokenize and /detokenize answer as vLLM's do. Every route but /health
needs `Authorization: Bearer KEY` when a key is set. /health answers 200 only
while the engine thread answers (every rank up, no failure); /metrics is Prometheus' text format.
`moelaunch_requests{status}` counts every call to a completion route once, by how it ended: the errors
here, the rest in handlers.py.
"""

from __future__ import annotations

import hmac
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from moelaunch.launcher.serve import handlers, responses
from moelaunch.launcher.serve import tokenize as tokenizing
from moelaunch.launcher.serve.handlers import APIError, ServerState
from moelaunch.launcher.serve.tokenize import DetokenizeRequest, TokenizeRequest

HEALTH_TIMEOUT_S = 5.0
COMPLETION_ROUTES = ("/v1/chat/completions", "/v1/completions")


def count(state: ServerState, path: str, status: int) -> None:
    if path in COMPLETION_ROUTES:
        state.metrics.requests.labels(str(status)).inc()


class RequireKey:
    """The API key check, as plain ASGI middleware: Starlette's @app.middleware("http") wraps `receive`
    so that a handler never sees its client go away (a whole call then ran to its end)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.state.api_key
        if scope["type"] == "http" and key is not None and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                count(self.state, scope["path"], 401)
                refusal = APIError(401, "missing or wrong API key: send Authorization: Bearer KEY")
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="moelaunch", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequireKey, state=state)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        count(state, request.url.path, error.status)
        return error.response()

    @app.exception_handler(Exception)
    async def bug(request: Request, error: Exception) -> JSONResponse:
        # Starlette still logs the traceback (and re-raises after this answer).
        count(state, request.url.path, 500)
        body = responses.error_body(
            f"internal server error ({type(error).__name__}); the server's log has the traceback",
            "server_error",
            None,
            500,
        )
        return JSONResponse(body, 500)

    @app.exception_handler(404)
    async def not_found(request: Request, error: Exception) -> JSONResponse:
        body = responses.error_body(
            f"no route {request.method} {request.url.path}", "not_found_error", None, 404
        )
        return JSONResponse(body, 404)

    @app.exception_handler(405)
    async def wrong_method(request: Request, error: Exception) -> JSONResponse:
        count(state, request.url.path, 405)
        body = responses.error_body(
            f"{request.method} is not allowed on {request.url.path}", "invalid_request_error", None, 405
        )
        return JSONResponse(body, 405)

    @app.get("/health")
    async def health() -> Response:
        if await state.engine_loop.ping(HEALTH_TIMEOUT_S):
            return JSONResponse({"status": "ok"})
        failure = state.engine_loop.failure
        return JSONResponse({"status": "unavailable", "error": str(failure) if failure else "no answer"}, 503)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": state.model_name, "object": "model", "created": created, "owned_by": "moelaunch",
                "max_model_len": state.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handlers.chat_completions(state, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handlers.completions(state, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = handlers.parse_body(TokenizeRequest, await handlers.read_json(request, state.max_body_bytes))
        return _or_400(lambda: tokenizing.tokenize(state, req))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = handlers.parse_body(DetokenizeRequest, await handlers.read_json(request, state.max_body_bytes))
        return _or_400(lambda: tokenizing.detokenize(state, req))

    return app


def _or_400(answer):
    try:
        return answer()
    except ValueError as e:
        raise APIError(400, str(e)) from None
