"""A witness between the sidecar and its `reflex stdio` child, for tests:

    python engine_proxy.py DIR -- ENGINE ARGV...

Runs ENGINE, passes lines both ways unchanged, and writes into DIR: `engine.pid` (the real engine's
pid, to kill it), `lines.jsonl` (every line, "in" to the engine or "out" of it) and `stats.json`
(how many requests the engine was sent while another was still unanswered, and answer lines
whose id was not the oldest unanswered request's). Cancel lines are the protocol's way to
interrupt, not requests of their own, and are not counted. Environment:
- REFLEX_PROXY_HOLD: a path; the `ready` line is held back until that file exists (a slow load).
- REFLEX_PROXY_STALL: a number N; after N token lines nothing more is passed to the sidecar
  (an engine stuck mid-generation, to be killed).
"""
import json
import os
import subprocess
import sys
import threading
import time


def main() -> int:
    folder, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
    engine = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    with open(os.path.join(folder, "engine.pid"), "w") as f:
        f.write(str(engine.pid))
    log = open(os.path.join(folder, "lines.jsonl"), "a", buffering=1)
    lock, owed = threading.Lock(), []
    stats = {"requests": 0, "overlapping": 0, "max_in_flight": 0, "misrouted": 0, "cancels": 0}

    def save():
        with open(os.path.join(folder, "stats.json.tmp"), "w") as f:
            json.dump(stats, f)
        os.replace(os.path.join(folder, "stats.json.tmp"), os.path.join(folder, "stats.json"))

    def to_engine():
        for raw in sys.stdin.buffer:
            line = json.loads(raw)
            with lock:
                log.write(json.dumps({"dir": "in", "t": time.monotonic(), "line": line}) + "\n")
                if line.get("op") == "cancel":
                    stats["cancels"] += 1
                else:
                    stats["requests"] += 1
                    stats["overlapping"] += bool(owed)
                    stats["max_in_flight"] = max(stats["max_in_flight"], len(owed) + 1)
                owed.append(line.get("id"))
                save()
            engine.stdin.write(raw)
            engine.stdin.flush()
        engine.stdin.close()

    threading.Thread(target=to_engine, daemon=True).start()
    hold, stall = os.environ.get("REFLEX_PROXY_HOLD"), int(os.environ.get("REFLEX_PROXY_STALL", "0"))
    tokens = 0
    for raw in engine.stdout:
        line = json.loads(raw)
        with lock:
            log.write(json.dumps({"dir": "out", "t": time.monotonic(), "line": line}) + "\n")
            if line["type"] == "ready":
                while hold and not os.path.exists(hold):
                    time.sleep(0.01)
            elif line["type"] == "token":
                tokens += 1
                stats["misrouted"] += not owed or line.get("id") != owed[0]
            else:  # a final line: the request is answered before the sidecar can see it
                stats["misrouted"] += not owed or line.get("id") != owed[0]
                if owed:
                    owed.pop(0)
                save()
        if stall and tokens > stall:
            continue
        sys.stdout.buffer.write(raw)
        sys.stdout.buffer.flush()
    return engine.wait()


if __name__ == "__main__":
    status = main()
    sys.exit(status if status >= 0 else 128 - status)
