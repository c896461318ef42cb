"""`reflex-openai MODEL`: bind the ports, start the engine child, serve until told to stop or until
the engine dies (then exit 1, so the platform replaces the worker)."""
from __future__ import annotations

import signal
import socket
import sys

from .config import Config, parse
from .process import spawn

GRACEFUL_SHUTDOWN_S = 30  # in-flight requests get this long after SIGTERM


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    try:
        sockets = _bind(cfg)
    except OSError as e:
        print(f"reflex-openai: cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        child = spawn(cfg.engine_argv())  # first: the engine loads while the HTTP stack imports (~0.2 s)
    except OSError as e:
        print(f"reflex-openai: cannot start the engine ({' '.join(cfg.engine_argv())}): {e}", file=sys.stderr)
        return 1
    import asyncio

    import uvicorn

    from .server import Sidecar

    sidecar = Sidecar(cfg, child)
    # http="h11": the parser the sidecar is tested with; "auto" would take httptools wherever some other
    # package installed it (the runpod SDK does, in the queue image), which answers disconnects differently
    server = uvicorn.Server(uvicorn.Config(sidecar, log_level=cfg.log_level, access_log=cfg.log_level in ("info", "debug"),
                                           lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, http="h11"))
    sidecar.server = server
    for sock in sockets:
        host, port = sock.getsockname()[:2]
        what = "health checks" if cfg.health_port and port == cfg.health_port and len(sockets) > 1 else "the API"
        print(f"reflex-openai: serving {what} on http://{host}:{port} (engine: {' '.join(cfg.engine_argv())})",
              file=sys.stderr, flush=True)
    stopped_by = []
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal it stopped for once it is done
        signal.signal(sig, lambda number, frame: stopped_by.append(number))
    asyncio.run(server.serve(sockets=sockets))
    if sidecar.exit_status == 0 and signal.SIGINT in stopped_by:
        return 130
    return sidecar.exit_status


def _bind(cfg: Config) -> list[socket.socket]:
    """The listening sockets, bound before the engine starts so that /healthz answers while it loads."""
    ports = [cfg.port] + ([cfg.health_port] if cfg.health_port is not None and cfg.health_port != cfg.port else [])
    sockets = []
    for port in ports:
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.create_server((cfg.host, port), family=family, backlog=2048)
        sock.setblocking(False)
        sockets.append(sock)
    if cfg.port == 0:  # the health port test in the app compares against the real one
        cfg.port = sockets[0].getsockname()[1]
    return sockets


if __name__ == "__main__":
    sys.exit(main())
