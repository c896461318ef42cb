"""Constrained decoding: a JSON schema, any JSON object, a regex or a grammar turned into a
token mask per step by llguidance (docs/perf-notes.md, issue 15, says why that engine).

Standard library at import: llguidance (the `structured` extra) is imported only when a
constraint is compiled, so a request without one never loads it.
"""
from __future__ import annotations

import ctypes
import json
import threading
import weakref
from typing import NamedTuple

from .errors import ReflexError

KINDS = ("json_schema", "json_object", "regex", "grammar")
# Fixed separators: a flexible-whitespace JSON grammar lets a small model pad forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_checked: dict = {}  # Constraint -> its checked grammar: the CLI checks before the load, generate again
_CHECKED_MAX = 64
_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> its _VocabularyBuild


class ConstraintError(ReflexError):
    """A schema, regex or grammar the engine cannot compile."""


class Constraint(NamedTuple):
    """What the output must match: kind (one of KINDS) and its source text (a JSON schema as
    JSON text, a regex, a Lark or GBNF grammar; empty for json_object)."""

    kind: str
    source: str = ""


def json_schema(schema) -> Constraint:
    """A JSON schema, as a dict or as JSON text."""
    return Constraint("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def json_object() -> Constraint:
    return Constraint("json_object")


def regex(pattern: str) -> Constraint:
    return Constraint("regex", pattern)


def grammar(text: str) -> Constraint:
    """A grammar in llguidance's Lark dialect or llama.cpp's GBNF."""
    return Constraint("grammar", text)


class Guide:
    """One generation's grammar state: the mask of tokens allowed next, packed as llguidance
    writes it (bit i of 32-bit word j allows token 32j + i: the form a device can upload).
    The matcher is made at the first mask, so the vocabulary's build (a thread) runs beside the
    prompt's evaluation."""

    def __init__(self, make_matcher, n_vocab: int):
        self._make_matcher, self._matcher = make_matcher, None
        self._mask = (ctypes.c_uint32 * ((n_vocab + 31) // 32))()

    def ready(self) -> None:
        """Wait for the vocabulary and make the matcher (the first mask does it otherwise)."""
        if self._matcher is None:
            self._matcher = self._make_matcher()

    def mask(self):
        """The packed mask for the next token (one buffer, rewritten every step)."""
        self.ready()
        self._matcher.unsafe_compute_mask_ptr(ctypes.addressof(self._mask), ctypes.sizeof(self._mask))
        return self._mask

    def advance(self, token: int) -> None:
        self.ready()
        if not self._matcher.consume_token(token):
            raise ReflexError(f"internal error: the grammar refused token {token} its own mask allowed: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows nothing more but the end."""
        self.ready()
        return self._matcher.is_stopped()


def prepare(tokenizer, gguf_file=None) -> None:
    """Start building llguidance's view of the vocabulary on a thread, if not yet begun: a caller
    that knows a constraint is coming calls this as soon as the tokenizer exists (the CLI: before
    the model loads). gguf_file: the model's, whose `reflex prepare` sidecar may hold the token
    bytes. Raises ReflexError without llguidance."""
    if tokenizer not in _vocabularies:
        _vocabularies[tokenizer] = _VocabularyBuild(_llguidance(), tokenizer, gguf_file)


def check(constraint: Constraint) -> str:
    """llguidance's grammar for the constraint, checked without a vocabulary (a few ms: the CLI
    calls it before the model loads); ConstraintError, one line, for a bad one."""
    source = _checked.get(constraint)
    if source is not None:
        return source
    if constraint.kind not in KINDS:
        raise ConstraintError(f"unknown constraint kind {constraint.kind!r} (one of {', '.join(KINDS)})")
    llg = _llguidance()
    if constraint.kind == "json_schema":
        _refuse_crashing_integers(constraint.source)
    source = _grammar_source(llg, constraint)
    error = llg.LLMatcher.validate_grammar(source)  # the vocabulary's token checks wait for the matcher
    if error:
        raise ConstraintError(f"invalid {constraint.kind.replace('_', ' ')}: {_one_line(error)}")
    if len(_checked) >= _CHECKED_MAX:
        _checked.pop(next(iter(_checked)))
    _checked[constraint] = source
    return source


def start(constraint: Constraint, tokenizer, gguf_file=None) -> Guide:
    """The compiled constraint, checked now (ConstraintError for a bad one); its matcher is made
    at the first mask, once the vocabulary's build (prepare) has ended."""
    source = check(constraint)
    prepare(tokenizer, gguf_file)
    llg, what = _llguidance(), f"invalid {constraint.kind.replace('_', ' ')}"

    def make_matcher():
        matcher = llg.LLMatcher(_vocabularies[tokenizer].result(), source, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"{what}: {_one_line(matcher.get_error())}")
        return matcher

    return Guide(make_matcher, tokenizer.n_vocab)


LLGUIDANCE_INT_FLOOR = -(1 << 63) + 512  # llguidance 1.9.1 dies (SIGSEGV) on an integer at or below it


def _refuse_crashing_integers(schema_text: str) -> None:
    """A one-line error, not a crashed process, for the integers llguidance cannot take (an enum
    or const of -2^63 + 512 or less: their double is -2^63)."""
    def integer(text: str) -> int:
        if int(text) <= LLGUIDANCE_INT_FLOOR:
            raise ConstraintError(f"invalid json schema: the integer {text} is below what the grammar engine takes "
                                  f"({LLGUIDANCE_INT_FLOOR + 1} and up)")
        return 0

    try:
        json.loads(schema_text, parse_int=integer)
    except ValueError:  # not JSON: the grammar engine says so
        pass


def _grammar_source(llg, c: Constraint) -> str:
    try:
        if c.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if c.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(c.source, defaults=JSON_OPTIONS)
        if c.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(c.source)
        from llguidance import grammar_from  # the package itself: its GBNF converter is Python

        return grammar_from("grammar", c.source)  # Lark as is, GBNF converted to Lark
    except (ValueError, TypeError) as e:  # not JSON, or a GBNF the converter cannot read
        raise ConstraintError(f"invalid {c.kind.replace('_', ' ')}: {_one_line(str(e))}") from None


class _VocabularyBuild:
    """llguidance's tokenizer for one Tokenizer, built on a thread: its Rust part (most of the
    ~0.5-1 s for 151k tokens, docs/perf-notes.md) runs without the GIL, beside the model's load
    and the prompt's evaluation."""

    def __init__(self, llg, tokenizer, gguf_file):
        self._vocabulary = self._error = None
        self._thread = threading.Thread(target=self._build, args=(llg, tokenizer, gguf_file),
                                        name="reflex-constraint-vocabulary", daemon=True)
        self._thread.start()

    def _build(self, llg, tokenizer, gguf_file) -> None:
        try:
            self._vocabulary = llg.LLTokenizer(_Encoder(tokenizer, gguf_file), eos_token=sorted(tokenizer.eog_ids) or None)
        except BaseException as e:  # raised again on the thread that asks for it
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._vocabulary


class _Encoder:
    """What llguidance reads off a tokenizer (its TokenizerWrapper's attributes and call)."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer, gguf_file=None):
        from .tokenizer.vocab import CONTROL, USER_DEFINED

        types = tokenizer.vocab.types
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids, default=0)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
        self.tokens = (gguf_file is not None and prepared_token_bytes(gguf_file, tokenizer.n_vocab)) or token_bytes(tokenizer)
        for i in self.special_token_ids:
            # llguidance's mark of a special token (as its llama.cpp binding): never text in a grammar
            if types[i] == CONTROL or self.tokens[i][:1] == b"<" and self.tokens[i][-1:] == b">":
                self.tokens[i] = b"\xff" + self.tokens[i]
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text, add_bos=False, parse_special=False)


# -- token bytes in the `reflex prepare` sidecar (sidecar.py) ---------------------------------------

TOKEN_BYTES_SECTION = "token_bytes"


def token_bytes_section(gguf_file, tokenizer) -> dict:
    """The sidecar section `reflex prepare` writes: every token's bytes as one blob and offsets,
    keyed by the tokenizer's fingerprint (a stale section is ignored)."""
    from array import array
    from itertools import accumulate

    from .tokenizer.cache import tokenizer_fingerprint

    pieces = token_bytes(tokenizer)
    offsets = array("I", accumulate(map(len, pieces), initial=0))
    return {"fingerprint": tokenizer_fingerprint(gguf_file), "blob": b"".join(pieces), "offsets": offsets.tobytes()}


def prepared_token_bytes(gguf_file, n_vocab: int) -> list[bytes] | None:
    """The token bytes from the sidecar section, or None where there is none fit for this file."""
    from array import array

    from . import sidecar
    from .tokenizer.cache import tokenizer_fingerprint

    section = sidecar.read_section(gguf_file.path, TOKEN_BYTES_SECTION)
    try:
        blob, offsets = section["blob"], array("I", section["offsets"])
        if (len(offsets) != n_vocab + 1 or offsets[0] != 0 or offsets[-1] != len(blob)
                or section["fingerprint"] != tokenizer_fingerprint(gguf_file)):
            return None
    except (TypeError, KeyError, ValueError):
        return None
    return list(map(blob.__getitem__, map(slice, offsets, offsets[1:])))


def token_bytes(tokenizer) -> list[bytes]:
    """Every token's Tokenizer.token_bytes, a byte-level BPE's normal tokens through the C charmap
    codec (one GPT-2 character, one byte) rather than a Python step per character: for 151k
    tokens ~0.05 s, not ~0.8."""
    import codecs
    from itertools import accumulate

    from .tokenizer.bpe import BYTE_TO_UNICODE
    from .tokenizer.vocab import NORMAL

    vocab = tokenizer.vocab
    if tokenizer.kind != "bpe":
        return [tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]
    table = codecs.charmap_build("".join(BYTE_TO_UNICODE))
    normal = [i for i, kind in enumerate(vocab.types) if kind == NORMAL]
    texts = [vocab.tokens[i] for i in normal]
    out: list = [None] * tokenizer.n_vocab
    try:
        data = codecs.charmap_encode("".join(texts), "strict", table)[0]
        for i, a, b in zip(normal, accumulate(map(len, texts), initial=0), accumulate(map(len, texts))):
            out[i] = data[a:b]
    except UnicodeEncodeError:  # a character outside the byte table (it stands for its UTF-8): token_bytes has it
        pass
    return [piece if piece is not None else tokenizer.token_bytes(i) for i, piece in enumerate(out)]


# -- a finite schema's instances: system1's candidates (engine.Model.system1) ---------------------

MAX_INSTANCES = 1024  # system1 scores every candidate in one pass: a larger set is refused
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs", "definitions",
                "deprecated", "readOnly", "writeOnly"}
_TYPE_OF = {"null": lambda v: v is None, "boolean": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
            "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer(),
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}


def schema_instances(schema, limit: int = MAX_INSTANCES) -> list[str]:
    """Every instance of a JSON schema whose instances form a finite set (enum, const, boolean,
    null, a bounded integer, anyOf/oneOf of such, objects with additionalProperties false whose
    properties are such, bounded arrays of such), as JSON text the way a constrained generate
    writes it (JSON_OPTIONS' separators, keys in the schema's order, optional ones absent or
    present in turn). ConstraintError, one line, for an infinite set, one over `limit`, or a
    keyword this expansion does not know."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ConstraintError(f"invalid json schema: {_one_line(str(e))}") from None
    try:
        texts = list(dict.fromkeys(map(_as_generated, _Expansion(schema, limit).values(schema, "$", 0))))
    except (TypeError, AttributeError, ValueError) as e:  # a keyword's value of the wrong kind; NaN
        raise ConstraintError(f"invalid json schema: {_one_line(str(e))}") from None
    if not texts:
        raise ConstraintError("the candidates' JSON schema allows no instance")
    return texts


class _Expansion:
    MAX_DEPTH = 32  # $refs deeper than this are a recursive schema: an infinite set

    def __init__(self, root, limit: int):
        self.root, self.limit = root, limit

    def refuse(self, where: str, why: str):
        return ConstraintError(f"system1 candidates need a schema with a finite set of at most {self.limit} instances "
                               f"(enum, const, boolean, bounded integers, objects and arrays of those): at {where}, {why}")

    def check_size(self, n: int, where: str) -> None:
        if n > self.limit:
            raise self.refuse(where, f"{n} instances or more")

    def values(self, s, where: str, depth: int) -> list:
        if s is True:
            raise self.refuse(where, "any value is allowed")
        if s is False:
            return []
        if not isinstance(s, dict):
            raise ConstraintError(f"invalid json schema: at {where}, a schema is an object or a boolean")
        if depth > self.MAX_DEPTH:
            raise self.refuse(where, f"the schema nests deeper than {self.MAX_DEPTH} (or refers to itself)")
        unknown = set(s) - _ANNOTATIONS - {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties",
                                           "required", "additionalProperties", "items", "prefixItems", "minItems",
                                           "maxItems", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
        if unknown:
            raise self.refuse(where, f"the keyword {sorted(unknown)[0]!r} is not supported here")
        if "$ref" in s:
            return self.with_type(s, self.values(self.resolve(s["$ref"], where), where, depth + 1), where)
        for key in ("anyOf", "oneOf", "allOf"):
            if key in s:
                branches = s[key]
                if not isinstance(branches, list) or not branches:
                    raise ConstraintError(f"invalid json schema: at {where}, {key} must be a non-empty array")
                if key == "allOf" and len(branches) > 1:
                    raise self.refuse(where, "allOf of more than one schema is not supported")
                rest = set(s) - _ANNOTATIONS - {key}
                if rest - {"type"}:
                    raise self.refuse(where, f"{key} beside {sorted(rest - {'type'})[0]!r} is not supported")
                out = []
                for i, branch in enumerate(branches):  # as a constrained generate, oneOf is anyOf
                    out += self.values(branch, f"{where}.{key}[{i}]", depth + 1)
                    self.check_size(len(out), where)
                return self.with_type(s, out, where)  # a sibling type narrows every branch
        if "const" in s or "enum" in s:
            found = [s["const"]] if "const" in s else s["enum"]
            if not isinstance(found, list):
                raise ConstraintError(f"invalid json schema: at {where}, enum must be an array")
            if "const" in s and "enum" in s:
                found = [v for v in found if any(_same(v, e) for e in s["enum"])]
            return self.with_type(s, found, where)
        types = s.get("type")
        if types is None:
            raise self.refuse(where, "no enum, const or type: any value is allowed")
        out = []
        for t in types if isinstance(types, list) else [types]:
            out += self.of_type(t, s, where, depth)
            self.check_size(len(out), where)
        return out

    def with_type(self, s: dict, found: list, where: str) -> list:
        """Values given outright (enum, const, a $ref's), kept where the schema's type allows them."""
        types = s.get("type")
        if types is not None:
            types = types if isinstance(types, list) else [types]
            if any(t not in _TYPE_OF for t in types):
                raise ConstraintError(f"invalid json schema: at {where}, unknown type {types!r}")
            found = [v for v in found if any(_TYPE_OF[t](v) for t in types)]
        self.check_size(len(found), where)
        return found

    def of_type(self, t, s: dict, where: str, depth: int) -> list:
        if t == "null":
            return [None]
        if t == "boolean":
            return [True, False]
        if t == "integer":
            if any(isinstance(s.get(k), bool) for k in ("exclusiveMinimum", "exclusiveMaximum")):
                raise self.refuse(where, "draft-04's boolean exclusiveMinimum/exclusiveMaximum is not supported")
            low, high = _bound(s, "minimum", "exclusiveMinimum", 1), _bound(s, "maximum", "exclusiveMaximum", -1)
            if low is None or high is None:
                raise self.refuse(where, "an integer without both a minimum and a maximum")
            self.check_size(high - low + 1, where)
            return list(range(low, high + 1))
        if t == "object":
            return self.objects(s, where, depth)
        if t == "array":
            return self.arrays(s, where, depth)
        if t in ("string", "number"):
            raise self.refuse(where, f"a {t} without enum or const")
        raise ConstraintError(f"invalid json schema: at {where}, unknown type {t!r}")

    def objects(self, s: dict, where: str, depth: int) -> list:
        if s.get("additionalProperties", True) is not False:
            raise self.refuse(where, "an object without \"additionalProperties\": false")
        props, required = s.get("properties", {}), s.get("required", [])
        missing = [k for k in required if k not in props]
        if missing:
            return []  # a required key no property allows
        out = [{}]
        for name, sub in props.items():
            vals = self.values(sub, f"{where}.{name}", depth + 1)
            options = [(name, v) for v in vals] + ([] if name in required else [None])
            self.check_size(len(out) * len(options), where)
            out = [{**o, name: kv[1]} if kv is not None else o for o in out for kv in options]
        return out

    def arrays(self, s: dict, where: str, depth: int) -> list:
        prefix, items = s.get("prefixItems", []), s.get("items", True)
        low = s.get("minItems", 0)
        high = s.get("maxItems", len(prefix) if items is False else None)
        if high is None:
            raise self.refuse(where, "an array without maxItems")
        high = min(high, len(prefix)) if items is False else high
        slots = [self.values(p, f"{where}[{i}]", depth + 1) for i, p in enumerate(prefix[:high])]
        if high > len(prefix):
            rest = self.values(items, f"{where}[]", depth + 1)
            slots += [rest] * (high - len(prefix))
        out, arrays = [[]], []
        for n in range(high + 1):
            if n >= low:
                arrays += out
                self.check_size(len(arrays), where)
            if n < high:
                self.check_size(len(out) * len(slots[n]), where)
                out = [a + [v] for a in out for v in slots[n]]
        return arrays

    def resolve(self, ref, where: str):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.refuse(where, f"the $ref {ref!r} is not inside the schema")
        node = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            try:
                node = node[int(part)] if isinstance(node, list) else node[part]
            except (KeyError, IndexError, ValueError, TypeError):
                raise ConstraintError(f"invalid json schema: at {where}, $ref {ref!r} points nowhere") from None
        return node


def _as_generated(v) -> str:
    """JSON text as llguidance's JSON grammar writes a value (checked against its matcher in
    tests/test_structured.py): JSON_OPTIONS' separators, keys in order, non-ASCII as is but DEL
    escaped, numbers as Rust prints them (no exponent, 1.0 as 1)."""
    if v is None or isinstance(v, bool):
        return "null" if v is None else "true" if v else "false"
    if isinstance(v, int):
        if not -(1 << 63) < v < 1 << 63:  # past i64 a constrained generate writes the nearest double
            raise ConstraintError(f"the candidates' JSON schema has the integer {v}, outside the 64-bit range")
        return str(v)
    if isinstance(v, float):
        from decimal import Decimal

        if v != v or v in (float("inf"), float("-inf")):
            raise ConstraintError("invalid json schema: NaN and Infinity are not JSON")
        text = format(Decimal(repr(v)), "f")  # repr: the shortest digits that read back as v
        return text.rstrip("0").rstrip(".") if "." in text else text
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + JSON_OPTIONS["item_separator"].join(map(_as_generated, v)) + "]"
    if isinstance(v, dict):
        key = JSON_OPTIONS["key_separator"]
        return "{" + JSON_OPTIONS["item_separator"].join(_as_generated(k) + key + _as_generated(x) for k, x in v.items()) + "}"
    raise ConstraintError(f"invalid json schema: {type(v).__name__} is not a JSON value")


def _bound(s: dict, inclusive: str, exclusive: str, step: int):
    """An integer range's end from minimum/exclusiveMinimum (step 1) or maximum/exclusiveMaximum (-1)."""
    import math

    ends = []
    for key, shift in ((inclusive, 0), (exclusive, step)):
        v = s.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = math.ceil(v) if step > 0 else math.floor(v)
            if key == exclusive and v == s[key]:
                v += shift
            ends.append(v)
    if not ends:
        return None
    return max(ends) if step > 0 else min(ends)


def _same(a, b) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    return type(a) is type(b) and a == b or _TYPE_OF["number"](a) and _TYPE_OF["number"](b) and a == b


def _llguidance():
    """llguidance's native module, loaded without its package's __init__, which spends ~40-130 ms
    in importlib.metadata for __version__ (and imports typing and dataclasses); the package is
    imported only for a Lark/GBNF grammar's converter."""
    import sys

    native = sys.modules.get("llguidance._lib")
    if native is not None:
        return native
    import importlib.machinery
    import importlib.util
    import os

    try:
        package = importlib.util.find_spec("llguidance")
    except (ImportError, ValueError):
        package = None
    if package is None or not package.submodule_search_locations:
        raise ReflexError("constraints need llguidance: pip install 'reflex-engine[structured]'")
    for folder in package.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "_lib" + suffix)
            if os.path.exists(path):
                spec = importlib.util.spec_from_file_location("llguidance._lib", path)
                native = importlib.util.module_from_spec(spec)
                sys.modules["llguidance._lib"] = native  # where the package's own import finds it later
                try:
                    spec.loader.exec_module(native)
                except BaseException:
                    del sys.modules["llguidance._lib"]
                    raise
                return native
    import llguidance  # an unusual layout: the package as it is

    return llguidance._lib


def _one_line(message: str) -> str:
    return " ".join(message.split())[:500]
