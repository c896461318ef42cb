"""The HTTP side: Starlette routes over the one engine child (engine.py), OpenAI's objects (api.py).

Many clients at the front door, one request at a time behind it: a handler waits for a turn on
the child, sends its generation, and streams or collects the answer. A client that goes away,
queued or mid-generation, gives its turn back, which cancels what it left running.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import traceback
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import api, structured
from .api import APIError
from .chat_output import ChatOutput
from .config import Config
from .engine import Busy, Engine, EngineError, Turn, Unavailable
from .metrics import CONTENT_TYPE, Metrics

MAX_BODY_BYTES = 32 << 20  # the engine takes request lines up to 16 MiB
HEALTH_PATHS = ("/ping", "/healthz")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class Sidecar:
    """One sidecar: its configuration, its engine child, its metrics, and the routes over them."""

    def __init__(self, cfg: Config, child=None):
        self.cfg, self.metrics, self._child = cfg, Metrics(), child  # child: a spawn()ed engine, else started here
        self.engine = Engine(cfg.engine_argv(), max_queue=cfg.max_queue, restart=cfg.on_engine_exit == "restart",
                             on_dead=self._engine_died, on_queue_change=self.metrics.queue_depth.set)
        self.exit_status = 0
        self.server = None  # the uvicorn.Server, told to stop once the engine has died
        self.created = int(time.time())
        routes = [Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/healthz", self.healthz, methods=["GET"]),
                  Route("/ping", self.ping, methods=["GET"]),
                  Route("/metrics", self.prometheus, methods=["GET"])]
        self.known_paths = {route.path for route in routes if "{" not in route.path}
        handlers = {APIError: _error_response, HTTPException: _http_error, Exception: _server_error}
        self.app = Starlette(routes=routes, exception_handlers=handlers, lifespan=self._lifespan)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.known_paths else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if self.cfg.health_port and (scope.get("server") or (None, None))[1] == self.cfg.health_port \
                and self.cfg.health_port != self.cfg.port and path not in HEALTH_PATHS:
            error = APIError(404, "this port serves only /ping and /healthz", code="not_found")
            return await _json_error(error)(scope, receive, counted)
        await self.app(scope, receive, counted)

    @asynccontextmanager
    async def _lifespan(self, app):
        await self.engine.start(self._child)
        yield
        await self.engine.close()

    def _engine_died(self) -> None:
        self.exit_status = 1
        self.metrics.engine_ready.set(0)
        asyncio.get_running_loop().call_later(self.cfg.exit_delay, self._stop)

    def _stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    # -- health ----------------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        """204 while the engine loads, 200 when it can serve, 503 once it died."""
        state = self.engine.state
        self.metrics.engine_ready.set(1 if state == "ready" else 0)
        if state == "loading":
            return Response(status_code=204)
        body = {"status": state, "model": self.cfg.name, "queued": self.engine.queued}
        if state == "dead":
            body["engine_exit_status"] = self.engine.exit_status
        return JSONResponse(body, status_code=200 if state == "ready" else 503)

    async def ping(self, request: Request) -> Response:
        """Runpod's load-balancer probe: 204 while initialising, 200 when healthy, 503 when not."""
        state = self.engine.state
        if state == "loading":
            return Response(status_code=204)
        return JSONResponse({"status": "healthy" if state == "ready" else "unhealthy"},
                            status_code=200 if state == "ready" else 503)

    async def prometheus(self, request: Request) -> Response:
        self.metrics.engine_ready.set(1 if self.engine.state == "ready" else 0)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # -- models ----------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_object())

    def _model_object(self) -> dict:
        return {"id": self.cfg.name, "object": "model", "created": self.created, "owned_by": "reflex"}

    def _check_model(self, name: str) -> None:
        if name != self.cfg.name:
            raise APIError(404, f"The model `{name}` does not exist or you do not have access to it.", param="model",
                           code="model_not_found")

    def _authorize(self, request: Request) -> None:
        if self.cfg.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.cfg.api_key.encode()):
            message = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
                       "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)." if not given else
                       "Incorrect API key provided.")
            raise APIError(401, message, code="invalid_api_key")

    # -- generation ------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, api.parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, api.parse_completion)

    async def engine_request(self, call: api.Call, turn: Turn) -> dict:
        """The engine's generate request for a call: its constraint, and its messages with what the
        engine's chat template is given besides them (a role-labelled prompt for a model file without one)."""
        request = call.request
        if call.kind != "chat":
            return request
        if not self.engine.info.get("chat_template"):
            template_only = [name for name in ("tools", "chat_template_kwargs") if name in request]
            if template_only:
                raise api.bad("this model file has no chat template to render tools or chat_template_kwargs with",
                              template_only[0])
            request = {k: v for k, v in request.items() if k != "messages"}
            request.update(prompt=api.fallback_prompt(call.request["messages"]), stop=[*call.stop, api.FALLBACK_STOP])
        markup = {}
        if structured.writes_calls(call.tools, call.response_format):
            markup = {text: await turn.tokens(text) for text in structured.MARKUP}
        return {**request, **structured.constraint(call.tools, call.response_format, markup)}

    async def _complete(self, request: Request, parse) -> Response:
        self._authorize(request)
        call = parse(await _json_body(request), self.cfg.defaults)
        self._check_model(call.model)
        arrived = time.monotonic()
        try:
            turn = await _unless_gone(request, self.engine.turn())
        except Busy:
            raise APIError(429, f"The server is busy: {self.cfg.max_queue} requests are already queued. Retry later.",
                           type="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.cfg.retry_after)}) from None
        except Unavailable as e:
            raise _unavailable(e) from None
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; counted as nginx counts a client that left
        run = Run(self, call, turn, arrived)
        if call.stream:
            try:
                first = await _unless_gone(request, run.next_line())
            except BaseException as e:
                turn.release()
                return _outcome_of(e, call)
            return EventStream(run.events(first), on_close=turn.release)
        with turn:
            try:
                return JSONResponse(await _unless_gone(request, run.collect()))
            except Exception as e:
                return _outcome_of(e, call)


class Run:
    """One generation in the engine on behalf of one HTTP request, and its answer in OpenAI's shape."""

    def __init__(self, sidecar: Sidecar, call: api.Call, turn: Turn, arrived: float):
        self.sidecar, self.call, self.turn, self.arrived = sidecar, call, turn, arrived
        self.meta = api.Meta.new(call, sidecar.cfg.name, f"reflex-{sidecar.engine.info.get('engine_version', '')}-"
                                 f"{sidecar.engine.info.get('device', '')}")
        self.lines = None  # the engine's lines, once the request is sent
        self.steps: list[dict] = []  # token lines that carry a token (and its logprobs)
        self.first_at: float | None = None
        self.output = ChatOutput(tools=call.tools is not None) if call.kind == "chat" else None
        self.calls = 0  # tool calls streamed so far

    async def next_line(self) -> dict:
        if self.lines is None:
            request = await self.sidecar.engine_request(self.call, self.turn)
            self.lines = self.turn.stream({**request, "stream": True})  # streamed always: TTFT and cancel for all
        line = await anext(self.lines)
        if line["type"] == "token":
            if line["token"] is not None:
                self.steps.append(line)
            if self.first_at is None:
                self.first_at = time.monotonic()
                self.sidecar.metrics.time_to_first_token.observe(self.first_at - self.arrived)
        else:
            self._finished(line)
        return line

    def _finished(self, result: dict) -> None:
        metrics, n = self.sidecar.metrics, result["usage"]["completion_tokens"]
        metrics.generated_tokens.inc(n)
        if n > 1 and self.first_at is not None and (elapsed := time.monotonic() - self.first_at) > 0:
            metrics.tokens_per_second.observe((n - 1) / elapsed)

    async def logprobs(self) -> dict | None:
        if not self.call.logprobs:
            return None
        texts = await self.turn.texts([step["token"] for step in self.steps])
        make = api.chat_logprobs if self.call.kind == "chat" else api.completion_logprobs
        return make(self.steps, texts)

    async def collect(self) -> dict:
        while (line := await self.next_line())["type"] == "token":
            pass
        pieces = self.output.feed(line["text"]) + self.output.finish() if self.output else []
        return api.response(self.call, self.meta, line, await self.logprobs(), pieces)

    def _released(self, text: str | None) -> list[bytes]:
        """The events for text the engine released (None: the end): a completion's as it came, a chat's
        split into reasoning, content and tool calls."""
        if self.output is None:
            return [_sse(api.chunk(self.call, self.meta, text=text))] if text else []
        events = []
        for piece in self.output.finish() if text is None else self.output.feed(text):
            self.calls += piece.kind == "call"
            events.append(_sse(api.chunk(self.call, self.meta, delta=api.piece_delta(piece, self.calls - 1))))
        return events

    async def events(self, line: dict):
        """The SSE stream, from the first line on. Each token's text goes out as it comes; log-probabilities,
        which need each token's own text from the engine, come with the finishing chunk."""
        call, meta = self.call, self.meta
        try:
            if call.kind == "chat":
                yield _sse(api.chunk(call, meta, delta=api.ROLE_DELTA))
            while line["type"] == "token":
                for event in self._released(line["text"]):
                    yield event
                line = await self.next_line()
            for event in self._released(None):
                yield event
            finish = api.finish_reason(line, self.calls > 0)
            yield _sse(api.chunk(call, meta, finish=finish, logprobs=await self.logprobs()))
            if call.include_usage:
                yield _sse(api.chunk(call, meta, usage=api.usage(line), final_usage=True))
            yield b"data: [DONE]\n\n"
        except (EngineError, Unavailable) as e:  # the status line is sent: the error goes in the stream
            yield _sse(_api_error(e, call).body())


class EventStream(StreamingResponse):
    """Server-sent events that run `on_close` however the response ends (done, client gone, error)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _unless_gone(request: Request, awaitable):
    """The awaitable's result, or ClientGone (the awaitable cancelled) if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)  # let it give back what it held
        watch.cancel()
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _json_body(request: Request) -> dict:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"The request body is larger than {MAX_BODY_BYTES >> 20} MiB.", code="body_too_large")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise api.bad(f"We could not parse the JSON body of your request ({e}). The body must be a JSON object.",
                      code="invalid_json") from None
    if not isinstance(body, dict):
        raise api.bad("The request body must be a JSON object.", code="invalid_json")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _unavailable(e: Exception) -> APIError:
    return APIError(503, f"The engine is unavailable: {e}.", type="server_error", code="engine_unavailable")


def _api_error(e: Exception, call: api.Call) -> APIError:
    if isinstance(e, EngineError):
        return api.engine_error(e.code, str(e), e.field, call)
    if isinstance(e, Unavailable):
        return _unavailable(e)
    if isinstance(e, APIError):
        return e
    traceback.print_exception(e, file=sys.stderr)
    return APIError(500, f"internal error in the sidecar: {type(e).__name__}", type="server_error", code="internal")


def _outcome_of(e: BaseException, call: api.Call) -> Response:
    """The response for a failure while serving; ClientGone and cancellation pass on."""
    if isinstance(e, ClientGone):
        return Response(status_code=499)
    if not isinstance(e, Exception):
        raise e
    return _json_error(_api_error(e, call))


def _json_error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _error_response(request, exc: APIError) -> Response:
    return _json_error(exc)


async def _http_error(request, exc: HTTPException) -> Response:
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = {404: f"Unknown URL: {request.method} {request.url.path}",
               405: f"Method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return _json_error(APIError(exc.status_code, message, code=codes.get(exc.status_code), headers=exc.headers))


async def _server_error(request, exc: Exception) -> Response:
    traceback.print_exception(exc, file=sys.stderr)
    return _json_error(APIError(500, f"internal error in the sidecar: {type(exc).__name__}", type="server_error",
                                code="internal"))

