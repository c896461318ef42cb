"""A stand-in for `reflex stdio` that answers every `generate` with text a test wrote: the pieces in
SCRIPT (a JSON list of strings, read afresh for each request), one token line each, then the result.
For the output a random-weight model never writes (Qwen3's <think> and <tool_call> markup).

    scripted_engine.py SCRIPT stdio MODEL [engine options]     (as the sidecar's --engine-cmd)
"""
import json
import sys


def send(line: dict) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def main() -> None:
    script, model = sys.argv[1], sys.argv[3]
    send({"type": "ready", "protocol_version": 1, "engine_version": "scripted", "model": model,
          "architecture": "qwen3", "device": "cpu", "n_ctx": 4096, "n_vocab": 384, "chat_template": True})
    for raw in sys.stdin:
        request = json.loads(raw)
        if request["op"] != "generate":
            send({"type": "result", "id": request.get("id"), "op": request["op"], "text": ""})
            continue
        with open(script) as f:
            pieces = json.load(f)
        for i, piece in enumerate(pieces):
            send({"type": "token", "id": request["id"], "token": i, "text": piece})
        prompt = request.get("prompt", [])
        send({"type": "result", "id": request["id"], "op": "generate", "text": "".join(pieces),
              "tokens": list(range(len(pieces))), "finish_reason": "eos",
              "usage": {"prompt_tokens": len(prompt), "cached_tokens": 0, "completion_tokens": len(pieces)}})


if __name__ == "__main__":
    main()
