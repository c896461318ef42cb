"""The one `reflex stdio` child and the turns it is lent out in (docs/protocol.md in the engine).

The child serves one request at a time, so HTTP handlers queue FIFO for a *turn*: while a handler
holds it, only its requests go to the child. A turn ends when the handler releases it; if a
generation is still running then, a `cancel` is sent, and the next turn is granted only once
every line the child owes (the generation's result, the cancel's) has been read. A line whose
id is not the one awaited means the two sides disagree on the stream: the child is killed.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time
from collections import deque
from typing import AsyncIterator, Callable

from .process import spawn

LINE_LIMIT = 64 << 20  # an answer line is far shorter; a request may be up to 16 MiB
STOP_WAIT_S = 5.0  # after closing stdin at shutdown, before the child is killed
POLL_S = 0.02  # how often a child that should be exiting is looked at


class Busy(Exception):
    """The queue is full (HTTP 429)."""


class Unavailable(Exception):
    """The child is not there to serve (HTTP 503)."""


class EngineError(Exception):
    """An `error` line answering a request: code, message and field as the protocol gives them."""

    def __init__(self, line: dict):
        super().__init__(line.get("message", ""))
        self.code, self.field = line.get("code"), line.get("field")


_GONE = object()  # put on a request's line queue when the child dies under it


class Engine:
    """Starts, watches and (on `restart`) respawns the child. States: loading, ready, dead."""

    def __init__(self, argv: list[str], *, max_queue: int, restart: bool, on_dead: Callable[[], None] = lambda: None,
                 on_queue_change: Callable[[int], None] = lambda n: None):
        self.argv, self.max_queue, self.restart = argv, max_queue, restart
        self.on_dead, self.on_queue_change = on_dead, on_queue_change
        self.state, self.info, self.exit_status = "loading", {}, None
        self.vocab: dict[int, str] = {}  # token id -> text, filled by detokenize; one child's vocabulary
        self.tokenized: dict[str, list[int]] = {}  # text -> its token ids, filled by tokenize; the same child's
        self._proc: subprocess.Popen | None = None
        self._stdin: asyncio.StreamWriter | None = None
        self._waiters: deque[asyncio.Future] = deque()
        self._turn: Turn | None = None
        self._owed: deque = deque()  # ids of the requests written whose final line is not read yet
        self._sink: tuple[int, asyncio.Queue] | None = None  # the request whose lines a turn reads
        self._ids = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._closing = False

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def start(self, child: subprocess.Popen | None = None) -> None:
        """Watch `child` (one spawn() started), or a new child."""
        self.state, self.info, self._owed, self.vocab, self.tokenized = "loading", {}, deque(), {}, {}
        try:
            proc = child or spawn(self.argv)
        except OSError as e:
            _log(f"cannot start the engine ({' '.join(self.argv)}): {e}")
            self.state = "dead"
            self.on_dead()
            return
        loop = asyncio.get_running_loop()
        stdout = asyncio.StreamReader(limit=LINE_LIMIT)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), proc.stdout)
        transport, protocol = await loop.connect_write_pipe(lambda: asyncio.StreamReaderProtocol(
            asyncio.StreamReader()), proc.stdin)
        self._proc, self._stdin = proc, asyncio.StreamWriter(transport, protocol, None, loop)
        self._reader = loop.create_task(self._read(proc, stdout))

    async def close(self) -> None:
        """Shut down: no new turns; the child sees the end of its input and exits (killed if it lingers)."""
        self._closing = True
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        if self._owed:
            self._write({"op": "cancel", "id": "shutdown"})
        self._stdin.close()
        await _exited(proc, STOP_WAIT_S)

    # -- turns ---------------------------------------------------------------------------------

    async def turn(self) -> Turn:
        """Wait, FIFO, for the child. Raises Busy at once when max_queue requests already wait,
        Unavailable when the child is dead (or dies while we wait)."""
        if self.state == "dead" or self._closing:
            raise Unavailable("the engine is not running")
        if not self._waiters and self._can_grant():
            return self._grant_to_caller()
        if len(self._waiters) >= self.max_queue:
            raise Busy(f"{len(self._waiters)} requests are already waiting")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.on_queue_change(len(self._waiters))
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                waiter.result().release()  # granted just as the caller went away
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
                self.on_queue_change(len(self._waiters))
            raise

    def _can_grant(self) -> bool:
        return self.state == "ready" and self._turn is None and not self._owed

    def _grant_to_caller(self) -> Turn:
        self._turn = Turn(self)
        return self._turn

    def _grant(self) -> None:
        while self._waiters and self._can_grant():
            waiter = self._waiters.popleft()
            if not waiter.cancelled():
                waiter.set_result(self._grant_to_caller())
        self.on_queue_change(len(self._waiters))

    def _released(self, turn: Turn) -> None:
        if self._turn is not turn:
            return
        if self._sink is not None and self._sink[0] in self._owed and self.state == "ready":
            self._write({"op": "cancel", "id": f"cancel-{self._sink[0]}"})
        self._sink, self._turn = None, None
        self._grant()

    # -- the pipes -----------------------------------------------------------------------------

    def _write(self, request: dict) -> None:
        self._owed.append(request["id"])  # every request we write has an id, and every one is answered
        try:
            # ASCII JSON: a lone surrogate sent by a client stays an escape, which the engine accepts
            self._stdin.write(json.dumps(request).encode() + b"\n")
        except (OSError, RuntimeError):
            pass  # the child has gone: the reader sees its end and fails the request

    def _send(self, turn: Turn, request: dict) -> asyncio.Queue:
        if self.state != "ready" or self._turn is not turn:  # a turn outlived by its child's death
            raise Unavailable("the engine is not running")
        request_id = next(self._ids)
        lines: asyncio.Queue = asyncio.Queue()
        self._sink = (request_id, lines)
        self._write({**request, "id": request_id})
        return lines

    async def _read(self, proc: subprocess.Popen, stdout: asyncio.StreamReader) -> None:
        broken = True  # the child broke the protocol: stop it now (rather than wait for its exit)
        try:
            ready = json.loads(await stdout.readline() or b"null")
            if not isinstance(ready, dict) or ready.get("type") != "ready":
                _log(f"the engine did not start: {ready.get('message') if isinstance(ready, dict) else 'no ready line'}")
                broken = False
                return
            self.info, self.state = ready, "ready"
            self._grant()
            while line := await stdout.readline():
                if not self._take(json.loads(line)):
                    _log(f"the engine's answer does not follow the protocol: {line[:200]!r}; stopping it")
                    return
            broken = False
        except (ValueError, asyncio.LimitOverrunError) as e:
            _log(f"unreadable line from the engine ({e}); stopping it")
        finally:
            await self._died(proc, 0 if broken else STOP_WAIT_S)

    def _take(self, line: dict) -> bool:
        """Route one answer line to the request it answers; False if it answers none."""
        if not isinstance(line, dict) or not self._owed or line.get("id") != self._owed[0]:
            return False
        if line.get("type") != "token":
            self._owed.popleft()
        if self._sink is not None and self._sink[0] == line["id"]:
            self._sink[1].put_nowait(line)
        if not self._owed:
            self._grant()
        return True

    async def _died(self, proc: subprocess.Popen, wait_s: float) -> None:
        self._stdin.close()
        self.exit_status = await _exited(proc, wait_s)
        if self._closing:
            return
        _log(f"the engine exited (status {self.exit_status})")
        self.state = "dead"
        if self._sink is not None:
            self._sink[1].put_nowait(_GONE)
        self._sink, self._turn, self._owed = None, None, deque()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(Unavailable("the engine exited"))
        self.on_queue_change(0)
        if self.restart and self.info:  # it had served: a child that cannot load would fail again
            _log("restarting the engine")
            await self.start()
        else:
            self.on_dead()


class Turn:
    """A lease on the child: requests go to it one at a time. Release it (or use `with`) when done."""

    def __init__(self, engine: Engine):
        self._engine = engine

    async def stream(self, request: dict) -> AsyncIterator[dict]:
        """Send one request; yield its token lines and then its final line. An `error` final line
        raises EngineError; the child's death raises Unavailable."""
        lines = self._engine._send(self, request)
        while True:
            line = await lines.get()
            if line is _GONE:
                raise Unavailable("the engine exited during the request")
            if line["type"] == "error":
                raise EngineError(line)
            yield line
            if line["type"] != "token":
                return

    async def call(self, request: dict) -> dict:
        async for line in self.stream(request):
            final = line
        return final

    async def texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (as `detokenize` gives it), cached for the child's lifetime."""
        vocab = self._engine.vocab
        for token in dict.fromkeys(ids):
            if token not in vocab:
                vocab[token] = (await self.call({"op": "detokenize", "ids": [token]}))["text"]
        return [vocab[token] for token in ids]

    async def tokens(self, text: str) -> list[int]:
        """text's token ids as the engine tokenizes a rendered chat (no BOS, control tokens parsed),
        cached for the child's lifetime."""
        tokenized = self._engine.tokenized
        if text not in tokenized:
            tokenized[text] = (await self.call({"op": "tokenize", "text": text, "add_bos": False}))["tokens"]
        return tokenized[text]

    def release(self) -> None:
        self._engine._released(self)

    def __enter__(self) -> Turn:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


async def _exited(proc: subprocess.Popen, wait_s: float) -> int:
    """The child's exit status, once it exits by itself within wait_s seconds, or is killed."""
    deadline = time.monotonic() + wait_s
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    if proc.poll() is None:
        proc.kill()
    while proc.poll() is None:
        await asyncio.sleep(POLL_S)
    return proc.returncode


def _log(message: str) -> None:
    print(f"reflex-openai: {message}", file=sys.stderr, flush=True)
