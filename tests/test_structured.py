"""Constrained decoding (constraints.py), on the CPU and, where a GPU is, on CUDA: 200 random JSON
schemas decoded on a random tiny model, each output parsed and validated with jsonschema; regexes
and grammars matched; the same requests without the constraint mostly invalid (so the mask is
what makes them valid); the CUDA sampler's masked distribution against the CPU sampler's on
random masks; bad constraints as one-line errors from the CLI and the IPC; nothing imported
without one."""
import ctypes.util
import json
import random
import re
import subprocess
import sys

import jsonschema
import pytest

import reflex_engine
from reflex_engine import constraints
from reflex_engine.engine import ModelFile
from reflex_engine.errors import ReflexError
from reflex_engine.sampling import SamplingParams

from model_files import GOLDEN_QWEN3, run_cli

pytest.importorskip("llguidance")

MAX_TOKENS = 160  # the schemas below bound every string and array: their outputs end well before
GREEDY, SEEDED = SamplingParams(temperature=0), SamplingParams(seed=15)
FORMATS = ("date", "uuid", "ipv4")  # bounded, and checked by jsonschema's FormatChecker without extras


HAS_CUDA = bool(ctypes.util.find_library("cuda"))


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def model(request):
    return reflex_engine.load(GOLDEN_QWEN3, device=request.param)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema whose every instance is short: strings, arrays and objects bounded."""
    kinds = ["string", "integer", "number", "boolean", "enum", "format"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        # a step: unbounded fraction digits are where a random model's greedy output never ends;
        # a power of two, so jsonschema's float division checks it exactly
        low = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(low, 2), "maximum": round(low + rng.uniform(0.5, 20), 2),
                "multipleOf": rng.choice([0.5, 0.25, 0.125])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True], rng.randint(1, 4))}
    if kind == "format":
        return {"type": "string", "format": rng.choice(FORMATS)}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "age", "tags", "kind", "score", "ok", "when"], rng.randint(1, 4))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": rng.sample(names, rng.randint(0, len(names))), "additionalProperties": False}


def schemas(n: int) -> list[dict]:
    rng = random.Random(20261215)
    out = []
    while len(out) < n:
        schema = random_schema(rng)
        if schema.get("type") == "object":  # the issue's case: structured extraction into an object
            out.append(schema)
    return out


def check(schema: dict, text: str) -> bool:
    try:
        instance = json.loads(text)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(instance)


def test_200_random_schemas_every_output_parses_and_validates(model):
    failures = []
    for i, schema in enumerate(schemas(200)):
        sampling = GREEDY if i % 2 else SamplingParams(seed=i)
        gen = model.generate(f"record {i}:", max_tokens=MAX_TOKENS, sampling=sampling, constraint=constraints.json_schema(schema))
        list(gen)
        if gen.finish_reason != "eos" or not check(schema, gen.text):
            failures.append((i, gen.finish_reason, gen.text, schema))
    assert not failures, failures[:3]


def test_without_the_constraint_the_same_requests_are_mostly_invalid(model):
    # the test above could pass with the mask ignored only if the model wrote valid JSON by itself
    sample = schemas(20)
    valid = 0
    for i, schema in enumerate(sample):
        gen = model.generate(f"record {i}:", max_tokens=40, sampling=GREEDY if i % 2 else SamplingParams(seed=i))
        list(gen)
        valid += check(schema, gen.text)
    assert valid <= 2


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no|maybe)", r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5}){0,2}\.",
                                     r"\d+(\.\d{1,2})?"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_regex_outputs_fullmatch(model, pattern, sampling):
    gen = model.generate("say:", max_tokens=MAX_TOKENS, sampling=sampling, constraint=constraints.regex(pattern))
    list(gen)
    assert gen.finish_reason == "eos" and re.fullmatch(pattern, gen.text), gen.text
    free = model.generate("say:", max_tokens=12, sampling=sampling)
    list(free)
    assert not re.fullmatch(pattern, free.text)


@pytest.mark.parametrize("text", ['start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/',  # Lark
                                  'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] [0-9]? [0-9]?'])  # GBNF
def test_grammars_in_lark_and_gbnf(model, text):
    for sampling in (GREEDY, SEEDED):
        gen = model.generate("tuple:", max_tokens=MAX_TOKENS, sampling=sampling, constraint=constraints.grammar(text))
        list(gen)
        assert gen.finish_reason == "eos" and re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", gen.text), gen.text


def test_json_object_and_logprobs(model):
    gen = model.generate("obj:", max_tokens=MAX_TOKENS, sampling=SEEDED, constraint=constraints.json_object(), logprobs=True)
    events = [e for e in gen if e.id is not None]
    assert all(e.logprob is not None for e in events)
    if gen.finish_reason == "eos":  # an unbounded object may not close within max_tokens on a random model
        assert isinstance(json.loads(gen.text), dict)
    assert gen.text.startswith("{")


@pytest.mark.parametrize("bad, message", [
    (constraints.json_schema("{not json"), "invalid json schema"),
    (constraints.json_schema({"type": "nonsense"}), "invalid json schema"),
    (constraints.regex("(ab"), "invalid regex"),
    (constraints.grammar("start: foo"), "invalid grammar"),
    (constraints.Constraint("xml"), "unknown constraint kind"),
    (constraints.json_schema({"enum": [1, -(2 ** 63) + 512]}), "below what the grammar engine takes"),  # llguidance: SIGSEGV
])
def test_bad_constraints_are_one_line_errors(model, bad, message):
    with pytest.raises(constraints.ConstraintError, match=message) as e:
        model.generate("x", constraint=bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("path", [GOLDEN_QWEN3, GOLDEN_QWEN3.replace("qwen3", "llama")])
def test_the_vocabulary_llguidance_gets_is_the_tokenizers(path):
    tokenizer = ModelFile(path).tokenizer
    assert constraints.token_bytes(tokenizer) == [tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]


def test_ignore_eos_with_a_constraint_is_refused(model):
    with pytest.raises(ReflexError, match="ignore_eos"):
        model.generate("x", constraint=constraints.json_object(), ignore_eos=True)


def test_cli_constraints_and_their_errors(tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    done = run_cli("generate", GOLDEN_QWEN3, "hi", "--device", "cpu", "--json-schema", str(path), "--json", "--seed", "1")
    assert done.returncode == 0, done.stderr
    assert check(schema, json.loads(done.stdout)["text"])
    done = run_cli("generate", GOLDEN_QWEN3, "hi", "--regex", "[ab]{3}", "--temp", "0", "--json")  # auto: the CPU
    assert done.returncode == 0 and re.fullmatch("[ab]{3}", json.loads(done.stdout)["text"]), done.stderr
    (tmp_path / "bad.json").write_text('{"type": ')
    for args, message in [(["--json-schema", str(tmp_path / "bad.json")], "invalid json schema"),
                          (["--regex", "(a"], "invalid regex"), (["--regex", "a", "--json-object"], "at most one"),
                          (["--grammar", str(tmp_path / "missing")], "cannot read")]:
        done = run_cli("generate", GOLDEN_QWEN3, "hi", *args)
        assert done.returncode != 0 and message in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.gpu
def test_cli_constraint_on_cuda(tmp_path):
    done = run_cli("generate", GOLDEN_QWEN3, "hi", "--regex", "[ab]{3}", "--temp", "0", "--json", "--device", "cuda")
    assert done.returncode == 0 and re.fullmatch("[ab]{3}", json.loads(done.stdout)["text"]), done.stderr
    assert json.loads(done.stdout)["device"] == "cuda"


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is here: the CUDA run is test_cli_constraint_on_cuda")
def test_cli_constraint_on_cuda_without_a_gpu_is_a_one_line_error():
    done = run_cli("generate", GOLDEN_QWEN3, "hi", "--regex", "a", "--device", "cuda")
    assert done.returncode != 0 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


CUDA_VOCAB = 151936  # Qwen's: a mask of 4,748 words, its last one full


@pytest.fixture(scope="module")
def cuda_ops():
    from reflex_engine.backends.cuda import CudaOps
    from reflex_engine.gguf import GGMLType
    from reflex_engine.ops import CacheShape

    ops = CudaOps()
    ops.reserve([(GGMLType.F32, (1 << 20,))], CacheShape(1, 256, 64, 64), activation_width=CUDA_VOCAB)
    return ops


def random_mask(rng, n_vocab: int, density: float):
    """A Guide-style packed mask (bit i of uint32 word j = token 32j + i) and the allowed ids."""
    allowed = sorted(rng.sample(range(n_vocab), max(1, int(n_vocab * density))))
    words = (ctypes.c_uint32 * ((n_vocab + 31) // 32))()
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return words, allowed


@pytest.mark.gpu
@pytest.mark.parametrize("params", [dict(temperature=0), dict(top_k=40, top_p=0.95, min_p=0.05), dict(top_k=0, top_p=1.0, min_p=0.0),
                                    dict(top_k=0, top_p=0.9, min_p=0.0), dict(top_k=300, top_p=1.0, min_p=0.0),
                                    dict(top_k=5, repeat_penalty=1.5, presence_penalty=0.7)])
@pytest.mark.parametrize("density", [0.0001, 0.003, 0.3, 1.0])
def test_cuda_masked_sampling_matches_the_cpu_sampler(cuda_ops, params, density):
    """Penalties, then the mask, then the filters: the CUDA sampler's (ids, probabilities) are the
    CPU sampler's, on random logits (ties at the top) and random masks, and the draw is allowed."""
    import numpy as np

    from reflex_engine.backends.cpu.sampler import Sampler

    ops, n_vocab = cuda_ops, CUDA_VOCAB
    rng, nrng = random.Random(repr((density, params))), np.random.default_rng(len(repr(params)))
    p = SamplingParams(**{"temperature": 0.8, "seed": 3, **params})
    for _ in range(3):
        logits = (nrng.standard_normal((1, n_vocab)) * 3).astype(np.float32)
        logits[0, rng.sample(range(n_vocab), 30)] = logits.max()  # ties at the top
        mask, allowed = random_mask(rng, n_vocab, density)
        history = rng.sample(range(n_vocab), 20) + allowed[:5]
        want_ids, want_probs = Sampler(p).distribution(logits[0], history, mask)
        sampler = ops.new_sampler(p)
        row = ops.from_host(logits)
        sampler._penalize(row.row(0), history)
        ids, probs = sampler.distribution(row.row(0), n_vocab, mask)
        assert ids == want_ids.tolist()
        np.testing.assert_allclose(probs, want_probs, rtol=1e-5, atol=1e-9)
        del row  # the activation pool holds two rows this wide
        allowed_set = set(allowed)
        draws = [ops.new_sampler(p._replace(seed=s))(ops.from_host(logits), history, mask=mask) for s in range(5)]
        assert set(draws) <= allowed_set, draws


def test_ipc_constraints_and_the_invalid_constraint_code():
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"], "additionalProperties": False}
    lines = [{"op": "generate", "id": 1, "prompt": "hi", "json_schema": schema, "temperature": 0},
             {"op": "generate", "id": 2, "prompt": "hi", "regex": "[0-9]{2}", "stream": True, "seed": 3},
             {"op": "generate", "id": 3, "prompt": "hi", "regex": "(a"},
             {"op": "generate", "id": 4, "prompt": "hi", "regex": "a", "grammar": "start: \"a\""},
             {"op": "generate", "id": 5, "prompt": "hi", "json_schema": "not an object"}]
    proc = subprocess.run([sys.executable, "-m", "reflex_engine", "stdio", GOLDEN_QWEN3, "--device", "cpu"], capture_output=True,
                          timeout=300, input="".join(json.dumps(line) + "\n" for line in lines).encode())
    assert proc.returncode == 0, proc.stderr[-2000:]
    answers = [json.loads(line) for line in proc.stdout.splitlines()][1:]
    finals = {a["id"]: a for a in answers if a["type"] != "token"}
    assert check(schema, finals[1]["text"]) and finals[1]["finish_reason"] == "eos"
    assert re.fullmatch("[0-9]{2}", finals[2]["text"])
    assert "".join(a["text"] for a in answers if a["type"] == "token" and a["id"] == 2) == finals[2]["text"]
    assert [finals[i]["code"] for i in (3, 4, 5)] == ["invalid_constraint", "invalid_request", "wrong_type"]


def test_no_constraint_imports_nothing_new(tmp_path):
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "reflex_engine", "generate", GOLDEN_QWEN3, "hi", "-n", "2",
                           "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "reflex_engine.constraints" not in imported and not any(m.startswith("llguidance") for m in imported)


# -- system1 with the candidates given as a finite JSON schema (constraints.schema_instances) ---------

WORDS = ["yes", "no", "maybe", "red", "grün", "日本", "a b", 'say "hi"', "tab\there", "", "x" * 12]


def random_value(rng: random.Random):
    kind = rng.choice(["str", "int", "bool", "null", "float"])
    if kind == "str":
        return rng.choice(WORDS) + rng.choice(["", str(rng.randint(0, 99))])
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":  # dyadic, so its shortest digits are the same in any language
        return (2 * rng.randint(-4000, 4000) + 1) / 8  # never integral (the grammar writes 1.0 as 1)
    return rng.choice([True, False]) if kind == "bool" else None


def literal(value) -> str:
    """The JSON text a constrained generate writes for a value of random_value's kinds (no DEL, no
    integral floats, no exponents): Python's own json with JSON_OPTIONS' separators."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def accepted_by_llguidance(model, schema: dict, text: str) -> bool:
    """The oracle: llguidance's matcher for the schema, as a constrained generate builds it,
    takes the text's tokens and may end there."""
    guide = constraints.start(constraints.json_schema(schema), model.tokenizer)
    guide.ready()
    matcher = guide._matcher
    return all(matcher.consume_token(t) for t in model.tokenize(text, add_bos=False, parse_special=False)) and matcher.is_accepting()


def test_system1_enum_candidates_score_as_the_same_literal_candidates(model):
    rng = random.Random(1507)
    for trial in range(6):
        values = []
        while len(values) < rng.randint(1, 8):
            v = random_value(rng)
            if literal(v) not in map(literal, values):
                values.append(v)
        texts = [literal(v) for v in values]
        schema = {"enum": values} if trial % 3 else {"anyOf": [{"const": v} for v in values], "description": "answer"}
        if trial % 3 == 2:
            schema = {"type": "object", "properties": {"answer": {"enum": values}, "sure": {"type": "boolean"}},
                      "required": ["answer", "sure"], "additionalProperties": False}
            texts = [f'{{"answer": {t}, "sure": {b}}}' for t in texts for b in ("true", "false")]
        prompt = f"question {trial}: pick one."
        by_schema = model.system1(prompt, json_schema=schema if trial % 2 else json.dumps(schema))
        by_text = model.system1(prompt, texts)
        assert [c.text for c in by_schema.candidates] == texts
        assert [(c.tokens, c.score, c.probability) for c in by_schema.candidates] == [
            (c.tokens, c.score, c.probability) for c in by_text.candidates]
        assert (by_schema.best, by_schema.entropy) == (by_text.best, by_text.entropy)
        assert "constraint_ms" in by_schema.timings


def random_finite_schema(rng: random.Random, depth: int = 0) -> tuple[dict, int]:
    """A schema with a finite instance set, and the size of that set counted here, independently."""
    kind = rng.choice(["enum", "const", "boolean", "null", "integer", "anyOf"] + (["object", "array"] if depth < 2 else []))
    if kind == "enum":
        values = list({literal(v): v for v in (random_value(rng) for _ in range(rng.randint(1, 4)))}.values())
        return {"enum": values}, len(values)
    if kind == "const":
        return {"const": random_value(rng)}, 1
    if kind in ("boolean", "null"):
        return {"type": kind}, 2 if kind == "boolean" else 1
    if kind == "integer":
        low = rng.randint(-30, 30)
        high = low + rng.randint(0, 6)
        if rng.random() < 0.5:
            return {"type": "integer", "exclusiveMinimum": low - 1, "exclusiveMaximum": high + 1}, high - low + 1
        return {"type": "integer", "minimum": low, "maximum": high}, high - low + 1
    if kind == "anyOf":  # disjoint branches: the count adds up
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        return {"anyOf": [{"type": "integer", "minimum": a, "maximum": a + 1}, {"enum": [f"s{b}", f"t{b}"]}]}, 4
    if kind == "array":
        item, n = random_finite_schema(rng, depth + 1)
        low = rng.randint(0, 1)
        high = low + rng.randint(0, 2)
        return {"type": "array", "items": item, "minItems": low, "maxItems": high}, sum(n ** k for k in range(low, high + 1))
    names = rng.sample(["id", "name", "kind", "ok", "when"], rng.randint(1, 3))
    props, required, count = {}, rng.sample(names, rng.randint(0, len(names))), 1
    for name in names:
        props[name], n = random_finite_schema(rng, depth + 1)
        count *= n + (name not in required)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}, count


def test_schema_instances_are_what_the_grammar_accepts_and_all_of_them(model):
    rng, checked = random.Random(4242), 0
    while checked < 40:
        schema, count = random_finite_schema(rng)
        if count > constraints.MAX_INSTANCES:
            with pytest.raises(constraints.ConstraintError, match="at most 1024 instances"):
                constraints.schema_instances(schema)
            continue
        texts = constraints.schema_instances(schema)
        assert len(texts) == len(set(texts)) == count, schema
        validator = jsonschema.Draft202012Validator(schema)
        for text in rng.sample(texts, min(len(texts), 8)):
            assert validator.is_valid(json.loads(text)), (schema, text)
            assert accepted_by_llguidance(model, schema, text), (schema, text)
        checked += 1


@pytest.mark.parametrize("value, text", [(1.0, "1"), (-0.0, "-0"), (1e20, "100000000000000000000"), (1e-7, "0.0000001"),
                                         (0.1, "0.1"), ("\x7fé", '"\\u007fé"'),
                                         ({"b": 1, "a": [True, None]}, '{"b": 1, "a": [true, null]}'),
                                         (2 ** 63 - 1, str(2 ** 63 - 1))])
def test_schema_instances_write_numbers_and_strings_as_the_grammar_does(model, value, text):
    assert constraints.schema_instances({"enum": [value]}) == [text]
    assert accepted_by_llguidance(model, {"enum": [value]}, text)


REFUSED = [({"type": "string"}, "a string without enum or const"),
           ({"type": "number", "minimum": 0, "maximum": 1}, "a number without enum or const"),
           ({"type": "object", "properties": {"a": {"type": "boolean"}}}, "additionalProperties"),
           ({"type": "array", "items": {"type": "boolean"}}, "without maxItems"),
           ({"type": "integer", "minimum": 0}, "both a minimum and a maximum"),
           ({"type": "integer", "minimum": 0, "maximum": 5000}, "5001 instances"),
           ({"type": "object", "properties": {f"k{i}": {"type": "boolean"} for i in range(11)}, "required": [f"k{i}" for i in range(11)],
             "additionalProperties": False}, "at most 1024 instances"),
           ({"$defs": {"t": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/t"}}}, "$ref": "#/$defs/t"}, "refers to itself"),
           ({"enum": ["a"], "pattern": "b"}, "'pattern' is not supported"),
           ({}, "any value is allowed"),
           ({"enum": [2 ** 64]}, "outside the 64-bit range"),
           ({"enum": []}, "allows no instance")]


@pytest.mark.parametrize("schema, message", REFUSED)
def test_infinite_or_large_candidate_schemas_are_refused_in_one_line(model, schema, message):
    with pytest.raises(constraints.ConstraintError, match=re.escape(message)) as e:
        model.system1("x", json_schema=schema)
    assert "\n" not in str(e.value)


def test_system1_schema_from_the_cli_and_the_ipc(tmp_path):
    schema = {"type": "object", "properties": {"label": {"enum": ["spam", "ham", "später"]},
                                               "n": {"type": "integer", "minimum": 1, "maximum": 2}},
              "required": ["label"], "additionalProperties": False}
    texts = [f'{{"label": "{w}"{n}}}' for w in ("spam", "ham", "später") for n in (', "n": 1', ', "n": 2', "")]
    (tmp_path / "s.json").write_text(json.dumps(schema), encoding="utf-8")
    by_schema = run_cli("system1", GOLDEN_QWEN3, "label:", "--device", "cpu", "--json-schema", str(tmp_path / "s.json"), "--json")
    by_text = run_cli("system1", GOLDEN_QWEN3, "label:", "--device", "cpu", "--json", *[a for t in texts for a in ("--candidate", t)])
    assert by_schema.returncode == 0 and by_text.returncode == 0, by_schema.stderr + by_text.stderr
    got, want = json.loads(by_schema.stdout), json.loads(by_text.stdout)
    assert [c["text"] for c in got["scores"]] == texts and got["scores"] == want["scores"] and got["best_idx"] == want["best_idx"]
    (tmp_path / "inf.json").write_text('{"type": "string"}')
    for args, message in [(["--json-schema", str(tmp_path / "inf.json")], "a string without enum or const"),
                          (["--json-schema", str(tmp_path / "s.json"), "--candidate", "a"], "not both"),
                          (["--json-schema", str(tmp_path / "missing.json")], "cannot read")]:
        done = run_cli("system1", GOLDEN_QWEN3, "label:", "--device", "cpu", *args)
        assert done.returncode != 0 and message in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr

    lines = [{"op": "system1", "id": 1, "prompt": "label:", "json_schema": schema},
             {"op": "system1", "id": 2, "prompt": "label:", "candidates": texts},
             {"op": "system1", "id": 3, "prompt": "label:", "json_schema": {"type": "string"}},
             {"op": "system1", "id": 4, "prompt": "label:", "json_schema": schema, "candidates": ["a"]},
             {"op": "system1", "id": 5, "prompt": "label:", "json_schema": "not an object"}]
    proc = subprocess.run([sys.executable, "-m", "reflex_engine", "stdio", GOLDEN_QWEN3, "--device", "cpu"], capture_output=True,
                          timeout=300, input="".join(json.dumps(line) + "\n" for line in lines).encode())
    assert proc.returncode == 0, proc.stderr[-2000:]
    answers = {a["id"]: a for a in map(json.loads, proc.stdout.splitlines()[1:])}
    assert answers[1]["candidates"] == answers[2]["candidates"] and [c["text"] for c in answers[1]["candidates"]] == texts
    assert [c["score"] for c in answers[1]["candidates"]] == [c["score"] for c in got["scores"]]  # the CLI's, exactly
    assert [answers[i].get("code") for i in (3, 4, 5)] == ["invalid_constraint", "invalid_request", "wrong_type"]
    assert "a string without enum or const" in answers[3]["message"]


# -- the first constraint's cost: a vocabulary built on a thread, token bytes from `reflex prepare` ---

def test_prepared_token_bytes_are_the_tokenizers_and_a_stale_section_is_ignored(tmp_path):
    import shutil

    from reflex_engine import sidecar
    from reflex_engine.gguf import GGUFFile

    path = str(tmp_path / "m.gguf")
    shutil.copy(GOLDEN_QWEN3, path)
    file = ModelFile(path)
    assert constraints.prepared_token_bytes(file.gguf, file.tokenizer.n_vocab) is None  # not prepared yet
    done = run_cli("prepare", path)
    assert done.returncode == 0, done.stderr
    file = ModelFile(path)
    want = [file.tokenizer.token_bytes(i) for i in range(file.tokenizer.n_vocab)]
    assert constraints.prepared_token_bytes(file.gguf, file.tokenizer.n_vocab) == want
    # what llguidance gets: the same from the sidecar as computed
    assert constraints._Encoder(file.tokenizer, file.gguf).tokens == constraints._Encoder(file.tokenizer).tokens
    # the same section under another tokenizer's fingerprint: ignored
    section = sidecar.read_section(path, constraints.TOKEN_BYTES_SECTION)
    sidecar.write_sections(path, {constraints.TOKEN_BYTES_SECTION: {**section, "fingerprint": (0, "little", 1, 2)}})
    assert constraints.prepared_token_bytes(GGUFFile(path), file.tokenizer.n_vocab) is None
    sidecar.write_sections(path, {constraints.TOKEN_BYTES_SECTION: {**section, "offsets": section["offsets"][:-4]}})
    assert constraints.prepared_token_bytes(GGUFFile(path), file.tokenizer.n_vocab) is None


def test_a_constrained_run_reports_constraint_ms_and_never_imports_the_llguidance_package(tmp_path):
    """The native module is loaded alone: the package's __init__ (importlib.metadata) stays out."""
    code = ("import sys, json, reflex_engine; from reflex_engine import constraints; "
            f"m = reflex_engine.load({GOLDEN_QWEN3!r}, device='cpu'); "
            "g = m.generate('x', max_tokens=8, constraint=constraints.regex('[0-9]{3}')); list(g); "
            "print(json.dumps([g.text, 'llguidance' in sys.modules, 'llguidance._lib' in sys.modules, "
            "'importlib.metadata' in sys.modules, g.timings]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text, package, native, metadata, timings = json.loads(done.stdout)
    assert re.fullmatch("[0-9]{3}", text) and native and not package and not metadata
    assert timings["constraint_ms"] > 0 and timings["constraint_ms"] <= timings["first_token_ms"]
    done = run_cli("generate", GOLDEN_QWEN3, "hi", "--regex", "[ab]{3}", "--device", "cpu", "-n", "5")
    assert done.returncode == 0 and "constraint_ms=" in done.stdout.splitlines()[-1], done.stderr
    done = run_cli("generate", GOLDEN_QWEN3, "hi", "--device", "cpu", "-n", "2")
    assert done.returncode == 0 and "constraint_ms=" not in done.stdout, done.stdout


def test_a_vocabulary_build_that_fails_on_its_thread_raises_where_the_mask_is_wanted(model, monkeypatch):
    from reflex_engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(model.tokenizer.vocab)  # a fresh one: no vocabulary built for it yet

    def broken(self, *args):
        raise ReflexError("the vocabulary broke")

    monkeypatch.setattr(constraints._Encoder, "__init__", broken)
    guide = constraints.start(constraints.regex("a+"), tokenizer)  # the grammar is checked without the vocabulary
    with pytest.raises(ReflexError, match="the vocabulary broke"):
        guide.mask()
