"""Writes openai-schemas.json: the response schemas of OpenAI's published OpenAPI spec for the
endpoints the sidecar serves, with every schema they reference, so tests check responses offline.

    git clone https://github.com/openai/openai-openapi && python vendor.py openai-openapi/openapi.json COMMIT
"""
import json
import sys

ROOTS = ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse",
         "ListModelsResponse", "Model", "ErrorResponse"]


def refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"].rsplit("/", 1)[1]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def main(spec_path: str, commit: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    schemas, kept, todo = spec["components"]["schemas"], {}, list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in kept:
            kept[name] = schemas[name]
            todo.extend(refs(schemas[name]))
    out = {"source": f"https://github.com/openai/openai-openapi/blob/{commit}/openapi.json",
           "openapi": spec["openapi"], "version": spec["info"]["version"],
           "components": {"schemas": dict(sorted(kept.items()))}}
    with open("openai-schemas.json", "w") as f:
        json.dump(out, f, indent=1, sort_keys=False)
        f.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
