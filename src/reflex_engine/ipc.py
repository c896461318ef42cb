"""`reflex stdio` and `reflex uds`: the JSON-lines protocol (protocol.py, docs/protocol.md) served
strictly one request at a time, on the Python API.

A reader thread only moves input lines into a queue; the main thread answers them in order, so a
request is not taken until the one before it is answered. While a generation runs, the main
thread looks at the lines that arrived, at every token boundary, for a cancel.
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import stat
import sys
import threading
import traceback
from collections import deque
from typing import Callable

from . import protocol
from .constraints import ConstraintError
from .errors import ContextExceeded, ReflexError
from .timing import reported_phases

EXIT_OK = 0
EXIT_DEVICE_LOST = 3  # the GPU failed under a request: this process cannot serve again, replace it
READ_CHUNK = 1 << 16

Send = Callable[[bytes], None]


class OutputClosed(Exception):
    """Whoever reads the answers has gone (a closed pipe or socket)."""


class Inbox:
    """Request lines in arrival order. The reader thread calls `read(n)` (os.read on stdin, recv on a
    socket; b"" at the end) and queues each line; it never runs a request."""

    def __init__(self, read: Callable[[int], bytes]):
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()
        self._ahead: deque = deque()  # taken from _arrived while looking for a cancel, not yet served
        threading.Thread(target=self._read_lines, args=(read,), name="reflex-ipc-reader", daemon=True).start()

    def _read_lines(self, read: Callable[[int], bytes]) -> None:
        line, overlong = bytearray(), False  # overlong: past MAX_LINE_BYTES, dropped up to its newline
        try:
            while chunk := read(READ_CHUNK):
                *ended, rest = chunk.split(b"\n")
                for part in ended:
                    line += part
                    self._arrived.put(protocol.OVERLONG if overlong or len(line) > protocol.MAX_LINE_BYTES else bytes(line))
                    line, overlong = bytearray(), False
                line += rest
                if len(line) > protocol.MAX_LINE_BYTES:
                    line, overlong = bytearray(), True
        except OSError:
            pass  # a connection reset ends its input as EOF does
        finally:
            if line or overlong:  # a last line without its newline
                self._arrived.put(protocol.OVERLONG if overlong else bytes(line))
            self._arrived.put(None)

    def next(self):
        """The next line to answer (bytes or protocol.OVERLONG), None once the input has ended."""
        return self._ahead.popleft() if self._ahead else self._arrived.get()

    def cancel_arrived(self) -> bool:
        """Whether a cancel request arrived since the last look; every line keeps its turn."""
        found = False
        while True:
            try:
                line = self._arrived.get_nowait()
            except queue.Empty:
                return found
            self._ahead.append(line)
            found = found or protocol.is_cancel(line)


class Session:
    """Answers one input's requests in order on a loaded model (an engine.Model)."""

    def __init__(self, model, inbox: Inbox, send: Send):
        self.model, self.inbox, self.send = model, inbox, send
        self._ops = {"generate": self._generate, "system1": self._system1, "tokenize": self._tokenize,
                     "detokenize": self._detokenize, "info": self._info, "ping": self._ping, "cancel": self._cancel}

    def serve(self) -> int:
        """Answer every line until the input ends (EXIT_OK) or the device is lost (EXIT_DEVICE_LOST).
        Raises OutputClosed when the answers can no longer be written."""
        while (line := self.inbox.next()) is not None:
            if not self._answer(line):
                return EXIT_DEVICE_LOST
        return EXIT_OK

    def _answer(self, line) -> bool:
        """Write the request's answer lines; False after a device failure (its error line written)."""
        request_id = None
        try:
            request = protocol.parse(line)
            request_id = request.id
            answer = protocol.encode(self._ops[request.op](request.id, request.args))
        except protocol.ProtocolError as e:
            answer = protocol.encode(protocol.error(e.request_id, e.code, str(e), e.field))
        except ContextExceeded as e:
            answer = protocol.encode(protocol.error(request_id, "context_exceeded", str(e)))
        except ConstraintError as e:
            answer = protocol.encode(protocol.error(request_id, "invalid_constraint", str(e)))
        except ReflexError as e:
            if _is_device_error(e):
                self.send(protocol.encode(protocol.error(request_id, "device_lost", str(e))))
                return False
            answer = protocol.encode(protocol.error(request_id, "invalid_request", str(e), e.field))
        except OutputClosed:
            raise
        except Exception as e:  # a bug: report it and keep serving
            traceback.print_exc(file=sys.stderr)
            answer = protocol.encode(protocol.error(request_id, "internal", f"{type(e).__name__}: {e}"))
        self.send(answer)
        return True

    # -- the ops: each returns its final line; generate may write token lines before it -----------

    def _generate(self, request_id, args: dict) -> dict:
        from .sampling import SamplingParams

        sampling = SamplingParams(**{k: v for k, v in args.items() if k in protocol.SAMPLING_FIELDS})
        stop = [args["stop"]] if isinstance(args.get("stop"), str) else args.get("stop", [])
        options = {k: args[k] for k in ("max_tokens", "ignore_eos", "logprobs", "top_logprobs", "import_kv", "export_kv")
                   if k in args}
        gen = self.model.generate(_prompt(args), sampling=sampling, stop=stop, constraint=_constraint(args), **options,
                                  **_template_inputs(args))
        stream, scored = args.get("stream", False), []
        for event in gen:
            if stream:
                self.send(protocol.encode({"type": "token", "id": request_id, "token": event.id, "text": event.text,
                                           **_scores(event)}))
            elif event.logprob is not None:
                scored.append({"token": event.id, **_scores(event)})
            if self.inbox.cancel_arrived():
                gen.cancel()
        answer = _result(request_id, "generate", text=gen.text, tokens=gen.tokens, finish_reason=gen.finish_reason,
                         usage={"prompt_tokens": gen.prompt_tokens, "cached_tokens": gen.cached_tokens,
                                "completion_tokens": len(gen.tokens)},
                         timings=reported_phases(gen.timings))
        if not stream and (args.get("logprobs") or args.get("top_logprobs")):
            answer["logprobs"] = scored
        return answer

    def _system1(self, request_id, args: dict) -> dict:
        state = {k: args[k] for k in ("import_kv", "export_kv") if k in args}
        result = self.model.system1(_prompt(args), args.get("candidates"), json_schema=args.get("json_schema"), **state,
                                    **_template_inputs(args))
        return _result(request_id, "system1", candidates=[c._asdict() for c in result.candidates], best=result.best,
                       entropy=result.entropy, usage={"prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens},
                       timings=reported_phases(result.timings))

    def _tokenize(self, request_id, args: dict) -> dict:
        tokens = self.model.tokenize(args["text"], add_bos=args.get("add_bos"), parse_special=args.get("parse_special", True))
        return _result(request_id, "tokenize", tokens=tokens)

    def _detokenize(self, request_id, args: dict) -> dict:
        return _result(request_id, "detokenize", text=self.model.detokenize(args["ids"]))

    def _info(self, request_id, args: dict) -> dict:
        return _result(request_id, "info", **_describe(self.model))

    def _ping(self, request_id, args: dict) -> dict:
        return {"type": "pong", "id": request_id}

    def _cancel(self, request_id, args: dict) -> dict:
        # A cancel stops the generation running when it arrives (Inbox.cancel_arrived); taken
        # in its turn, it only answers.
        return _result(request_id, "cancel")


def _prompt(args: dict):
    return args["prompt"] if "prompt" in args else args["messages"]


def _template_inputs(args: dict) -> dict:
    """What the request gives the chat template besides its messages."""
    return {k: args[k] for k in protocol.TEMPLATE_FIELDS if k in args}


def _constraint(args: dict):
    """The request's constraint field (protocol.parse let at most one through), or None."""
    given = [name for name in protocol.CONSTRAINT_FIELDS if args.get(name, False) is not False]
    if not given:
        return None
    from . import constraints

    name = given[0]
    if name == "json_schema":
        return constraints.json_schema(args[name])
    return constraints.Constraint(name, "" if name == "json_object" else args[name])


def _result(request_id, op: str, **fields) -> dict:
    return {"type": "result", "id": request_id, "op": op, **fields}


def _scores(event) -> dict:
    """A token's logprob fields: none without logprobs."""
    fields = {}
    if event.logprob is not None:
        fields["logprob"] = event.logprob
    if event.top_logprobs is not None:
        fields["top_logprobs"] = [t._asdict() for t in event.top_logprobs]
    return fields


def _is_device_error(e: ReflexError) -> bool:
    """Any failed driver call under a request: the context's state is unknown from then on (an
    illegal address or a lost device poisons it for good), so the process must be replaced."""
    from .backends.cuda.driver import CudaError  # loads nothing: the driver opens with a CudaOps

    return isinstance(e, CudaError)


def _describe(model) -> dict:
    """What the ready line and the info op say about the model being served."""
    from . import __version__

    return {"protocol_version": protocol.PROTOCOL_VERSION, "engine_version": __version__, "model": model.file.gguf.path,
            "architecture": model.config.arch, "device": model.device, "n_ctx": model.n_ctx,
            "n_vocab": model.config.n_vocab, "chat_template": model.file.chat_template is not None}


def _ready_line(model) -> bytes:
    from .timing import since_start_ms

    timings = {**reported_phases(model.file.timings.phases), "ready_ms": round(since_start_ms(), 3)}
    return protocol.encode({"type": "ready", **_describe(model), "timings": timings})


def _sender(write: Callable[[bytes], object]) -> Send:
    def send(data: bytes) -> None:
        try:
            write(data)
        except OSError as e:
            raise OutputClosed(str(e)) from None

    return send


def _file_sender(file) -> Send:
    def write(data: bytes) -> None:
        file.write(data)
        file.flush()

    return _sender(write)


def _load(path: str, device: str, n_ctx: int | None, send: Send, lora=()):
    """The model; a load failure is an error line (code load_failed), then raised for the CLI."""
    from . import load

    try:
        return load(path, device=device, n_ctx=n_ctx, lora=lora)
    except ReflexError as e:
        send(protocol.encode(protocol.error(None, "load_failed", str(e))))
        raise


# -- stdio -------------------------------------------------------------------------------------------


def serve_stdio(path: str, device: str = "auto", n_ctx: int | None = None, lora=()) -> int:
    """Requests on stdin, answers on stdout, until stdin ends. Returns the exit code. lora: as
    reflex_engine.load's."""
    send = _file_sender(_protocol_stdout())
    model = _load(path, device, n_ctx, send, lora)
    try:
        send(_ready_line(model))
        return Session(model, Inbox(lambda n: os.read(0, n)), send).serve()
    except OutputClosed:
        return EXIT_OK  # the reader went away: nobody is left to answer


def _protocol_stdout():
    """A file on stdout for the protocol alone: fd 1 then points at stderr, so a stray print (or a
    library writing to fd 1) cannot break the line stream."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return out


# -- Unix socket -------------------------------------------------------------------------------------


def serve_unix(path: str, socket_path: str, device: str = "auto", n_ctx: int | None = None, lora=()) -> int:
    """Listen on a Unix socket; serve one connection at a time, to its end, then take the next.
    Runs until SIGTERM or SIGINT, or a device failure. Returns the exit code."""
    listener = _listen(socket_path)  # first: a bad path fails before the model loads
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_OK))
    try:
        announce = _file_sender(sys.stdout.buffer)
        model = _load(path, device, n_ctx, announce, lora)
        ready = _ready_line(model)
        announce(ready)  # for the supervisor that started us: connections are served from now on
        while True:
            conn, _ = listener.accept()
            with conn:
                code = _serve_connection(model, conn, ready)
            if code != EXIT_OK:
                return code
    finally:
        listener.close()
        os.unlink(socket_path)


def _serve_connection(model, conn: socket.socket, ready: bytes) -> int:
    send = _sender(conn.sendall)
    try:
        send(ready)
        return Session(model, Inbox(conn.recv), send).serve()
    except OutputClosed:
        return EXIT_OK
    finally:
        try:
            conn.shutdown(socket.SHUT_RDWR)  # wakes the reader thread if it still waits in recv
        except OSError:
            pass  # the peer has already gone


def _listen(path: str) -> socket.socket:
    """A listening socket at path. A socket file nobody listens on (left by a killed run) is
    replaced; a live one, or any other file, is refused."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ReflexError(f"{path} exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            if probe.connect_ex(path) == 0:
                raise ReflexError(f"another process is serving {path}")
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen()
    except OSError as e:
        listener.close()
        raise ReflexError(f"cannot listen on {path}: {e.strerror or e}") from None
    return listener
