"""Where file, architecture and backend meet: open a model, evaluate batches, generate, score.

ModelFile is the host-side half (GGUF, architecture config, tokenizer) and imports no numpy,
so a caller can open the file and encode the prompt before any backend exists. Model adds
a backend and the weights on it.
"""
from __future__ import annotations

import math
import time
from typing import Any, Iterator, Mapping, NamedTuple, Sequence, Union

from .arch import get_arch
from .arch.weights import load_weights, plan_weights
from .errors import ContextExceeded, ReflexError
from .gguf import GGUFFile
from .ops import Batch, CacheShape
from .timing import Timings
from .tokenizer import Tokenizer

# Text, token ids (no BOS added), or chat messages (rendered with the model's chat template).
Prompt = Union[str, Sequence[int], Sequence[Mapping[str, Any]]]
MAX_TOP_LOGPROBS = 20  # as OpenAI's API


class ModelFile:
    """A GGUF model opened on the host: metadata, architecture config, tokenizer."""

    def __init__(self, path: str, timings: Timings | None = None):
        self.timings = timings or Timings()
        with self.timings.phase("gguf_open"):
            self.gguf = GGUFFile(path)
            meta = self.gguf.metadata
            self.arch = get_arch(meta.get("general.architecture"))
            self.config = self.arch.config(meta)
        with self.timings.phase("tokenizer"):
            self.tokenizer = Tokenizer.from_gguf(self.gguf)
        if self.tokenizer.n_vocab != self.config.n_vocab:
            raise ReflexError(f"{path}: tokenizer has {self.tokenizer.n_vocab} tokens, the model {self.config.n_vocab}")

    @property
    def chat_template(self) -> str | None:
        return self.gguf.metadata.get("tokenizer.chat_template")

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=parse_special)

    def render_chat(self, messages: list[dict], **kwargs) -> str:
        """The chat template rendered as transformers' apply_chat_template renders it; kwargs go
        to chat.render_chat (add_generation_prompt, tools, documents, template variables)."""
        from .chat import render_chat

        # as in transformers, a call with tools takes the model's tool_use template if it has one
        tool_use = kwargs.get("tools") is not None and self.gguf.metadata.get("tokenizer.chat_template.tool_use")
        template = tool_use or self.chat_template
        if not template:
            raise ReflexError(f"{self.gguf.path} has no chat template (tokenizer.chat_template)")
        tok = self.tokenizer
        tokens = {name: tok.decode([token], special=True) for name, token in
                  (("bos_token", tok.bos_id), ("eos_token", tok.eos_id)) if token is not None}
        return render_chat(template, messages, **{**tokens, **kwargs})

    def load(self, device: str = "auto", n_ctx: int | None = None) -> Model:
        from .backends import create_backend

        if n_ctx is not None and n_ctx < 1:
            raise ReflexError(f"the context size must be at least 1 token, not {n_ctx}")
        with self.timings.phase("backend_init"):
            ops = create_backend(device)
        n_ctx = n_ctx or self.config.n_ctx_train
        c, arch = self.config, self.arch
        with self.timings.phase("model_load"):
            plan = plan_weights(self.gguf, c, arch.TENSORS, arch.LAYER_TENSORS)
            shape = CacheShape(c.n_layers, n_ctx, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.v_head_dim)
            ops.reserve([(t.ggml_type, t.shape) for t in plan.values() if t is not None], shape, c.activation_width)
            weights = load_weights(self.gguf, c, plan, arch.TENSORS, arch.LAYER_TENSORS, ops)
            cache = ops.new_kv_cache(shape)
        return Model(self, ops, weights, cache, n_ctx)


class TokenLogprob(NamedTuple):
    token: int
    text: str  # the token alone (special tokens as written); a split character shows as U+FFFD
    logprob: float


class TokenEvent(NamedTuple):
    id: int | None  # None on a last event that only releases held-back text
    text: str  # safe to print: whole characters, stop-string prefixes held back
    logprob: float | None = None  # with logprobs: log P(id), see Model.generate
    top_logprobs: list[TokenLogprob] | None = None  # with top_logprobs=k: the k likeliest, likeliest first


class Generation:
    """Iterate for TokenEvents; after that, the summary fields are filled in."""

    def __init__(self, prompt_tokens: int, timings: dict[str, float]):
        self.prompt_tokens = prompt_tokens
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "eos", "stop", "length" or "cancelled"
        self.timings = timings  # the *_ms phases
        self._events: Iterator[TokenEvent] = iter(())
        self._cancelled = False

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._events

    def cancel(self) -> None:
        """End at the next token boundary with finish_reason "cancelled"; callable from any thread."""
        self._cancelled = True

    @property
    def tokens_per_s(self) -> float:
        """Decode rate: the tokens after the first (which ends the prompt eval) over their time."""
        seconds = self.timings.get("decode_ms", 0.0) / 1e3
        return (len(self.tokens) - 1) / seconds if seconds > 0 and len(self.tokens) > 1 else 0.0


class Candidate(NamedTuple):
    index: int
    text: str
    tokens: list[int]
    score: float  # log P(candidate | prompt), summed over its tokens (nats)
    probability: float  # softmax of the scores over the candidate set


class System1Result(NamedTuple):
    candidates: list[Candidate]
    best: int
    entropy: float  # of the candidate distribution, nats
    prompt_tokens: int
    timings: dict[str, float]


class Model:
    """A model on a backend. One request at a time: every request reuses the one KV cache."""

    def __init__(self, file: ModelFile, ops, weights, cache, n_ctx: int):
        self.file, self.ops, self.weights, self.cache, self.n_ctx = file, ops, weights, cache, n_ctx
        self.config, self.tokenizer = file.config, file.tokenizer

    @property
    def device(self) -> str:
        return self.ops.name

    # -- text --------------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        return self.file.encode(text, add_bos=add_bos, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        self._check_ids(ids)
        return self.tokenizer.decode(ids)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.token_bytes(token).decode("utf-8", "replace")

    # -- evaluation ----------------------------------------------------------------------------

    def _check_ids(self, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.config.n_vocab]
        if bad:
            raise ReflexError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.n_vocab - 1})")

    def _passes(self, batch: Batch, out_rows: Sequence[int]) -> Iterator[tuple[list[int], object]]:
        """Evaluate the batch in passes of at most ops.max_batch tokens (later passes attend to
        what earlier ones wrote to the cache). Yields, for each pass holding wanted rows, their
        indices into out_rows and the backend's logits for them, in that order."""
        step, n = self.ops.max_batch, len(batch.tokens)
        for a in range(0, n, step):
            b = min(n, a + step)
            wanted = [i for i, r in enumerate(out_rows) if a <= r < b]
            part = Batch(batch.tokens[a:b], batch.positions[a:b], batch.segments[a:b], batch.start + a)
            logits = self.file.arch.forward(self.ops, self.weights, self.config, self.cache, part, [out_rows[i] - a for i in wanted])
            if wanted:
                yield wanted, logits
            del logits  # before the next pass, so a device backend can reuse the buffer

    def _next_logits(self, batch: Batch):
        """The backend's logits (1, V) after the batch's last token."""
        *_, (_, logits) = self._passes(batch, [len(batch.tokens) - 1])
        return logits

    def logits(self, token_ids: Sequence[int]):
        """float32 (len(token_ids), V): next-token logits at every position. No BOS is added."""
        import numpy as np

        ids = list(token_ids)
        if not ids:
            raise ReflexError("logits needs at least one token")
        self._check_ids(ids)
        self._check_fits(len(ids), "the input")
        parts = []
        for _, logits in self._passes(Batch.causal(ids, 0), range(len(ids))):
            parts.append(self.ops.to_host(logits))
            del logits  # a device backend reuses its buffer in the next pass
        return np.concatenate(parts)

    def _check_fits(self, n: int, what: str) -> None:
        if n > self.n_ctx:
            raise ContextExceeded(f"{what} is {n} tokens, longer than the context ({self.n_ctx})")

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        elif len(prompt) and isinstance(prompt[0], Mapping):
            ids = self.tokenize(self.file.render_chat(list(prompt)), add_bos=False)  # the template writes its BOS
        else:
            ids = list(prompt)
        if not ids:
            raise ReflexError("the prompt is empty (it tokenizes to no tokens)")
        self._check_ids(ids)
        return ids

    # -- generate ------------------------------------------------------------------------------

    def generate(self, prompt: Prompt, max_tokens: int = 128, sampling=None, stop: Sequence[str] = (),
                 ignore_eos: bool = False, logprobs: bool = False, top_logprobs: int = 0) -> Generation:
        """Stream the continuation of `prompt` (text, token ids or chat messages) as TokenEvents.

        logprobs: each event carries log P(token) under the model's own distribution, the
        log-softmax of its logits before penalties, temperature and the top-k/top-p/min-p filters
        (as llama.cpp's server reports them by default). top_logprobs=k (0..20) also gives the k
        likeliest tokens under that distribution, and implies logprobs. Generation.cancel() ends
        the generation at the next token boundary.
        """
        from .sampling import SamplingParams

        if max_tokens < 1 and max_tokens != -1:
            raise ReflexError("max tokens must be at least 1 (or -1: until the context is full)")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ReflexError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
        ids = self._prompt_ids(prompt)
        self._check_fits(len(ids), "the prompt")
        if len(ids) == self.n_ctx:
            raise ContextExceeded(f"the prompt fills the whole context ({self.n_ctx} tokens) and leaves no room to generate")
        if any(not s for s in stop):
            raise ReflexError("a stop string must not be empty")
        sampler = self.ops.new_sampler(sampling or SamplingParams())
        eog = frozenset() if ignore_eos else self.tokenizer.eog_ids
        timings = self.file.timings.fork()
        gen = Generation(len(ids), timings.phases)
        n_top = top_logprobs if logprobs or top_logprobs else None
        gen._events = self._generate(gen, timings, ids, max_tokens, sampler, tuple(stop), eog, n_top)
        return gen

    def _choose(self, logits, history: list[int], sampler, n_top: int | None) -> tuple[int, tuple]:
        """The next token from logits (1, V), and the TokenEvent fields that score it: none without
        n_top, else its log-probability and the n_top likeliest tokens (None for 0)."""
        if n_top is None:
            return sampler(logits, history), ()  # reading the choice waits for the device
        raw = self.ops.take_rows(logits, [0])  # the model's own logits: the sampler may penalize in place
        token = sampler(logits, history)
        logprob = self.ops.token_logprobs(raw, [(0, token)])[0]
        if not n_top:
            return token, (logprob, None)
        top = self.ops.top_logprobs(raw, 0, n_top)
        return token, (logprob, [TokenLogprob(t, self._token_text(t), lp) for t, lp in top])

    def _generate(self, gen: Generation, timings: Timings, ids: list[int], max_tokens: int, sampler,
                  stop: tuple[str, ...], eog, n_top: int | None):
        capacity = self.n_ctx if max_tokens == -1 else min(self.n_ctx, len(ids) + max_tokens)
        history, n_past = list(ids), len(ids)
        with timings.phase("prompt_eval"):
            token, scored = self._choose(self._next_logits(Batch.causal(ids, 0)), history, sampler, n_top)
        timings.mark("first_token")
        stream, text, emitted = self.tokenizer.stream(), "", 0
        decode_start = time.perf_counter()
        while True:
            if token in eog:
                gen.finish_reason = "eos"
                break
            gen.tokens.append(token)
            history.append(token)
            text += stream.feed(token)
            cut = _find_stop(text, stop, emitted)
            if cut is not None:
                yield TokenEvent(token, text[emitted:cut], *scored)
                text, emitted = text[:cut], cut
                gen.finish_reason = "stop"
                break
            safe = len(text) - _held_back(text, stop)
            yield TokenEvent(token, text[emitted:safe], *scored)
            emitted = max(emitted, safe)
            if gen._cancelled:
                gen.finish_reason = "cancelled"
                break
            if len(gen.tokens) == max_tokens or n_past == capacity:
                gen.finish_reason = "length"
                break
            # the logits go out of scope inside _choose: the next step's take the same device buffer
            token, scored = self._choose(self._next_logits(Batch.causal([token], n_past)), history, sampler, n_top)
            n_past += 1
        if gen.finish_reason != "stop":
            text += stream.flush()
            if emitted < len(text):  # held-back text, or an unfinished character as U+FFFD
                yield TokenEvent(None, text[emitted:])
        gen.text = text
        timings.phases["decode_ms"] = (time.perf_counter() - decode_start) * 1e3
        timings.mark("total")

    # -- system1 -------------------------------------------------------------------------------

    def system1(self, prompt: Prompt, candidates: Sequence[str]) -> System1Result:
        """Score every candidate continuation in one forward pass (see ops.Batch for the mask)."""
        if not candidates:
            raise ReflexError("system1 needs at least one candidate")
        timings = self.file.timings.fork()
        p_ids = self._prompt_ids(prompt)
        c_ids = [self.tokenize(c, add_bos=False) for c in candidates]
        for i, (text, ids) in enumerate(zip(candidates, c_ids)):
            if not ids:
                raise ReflexError(f"candidate {i} ({text!r}) tokenizes to no tokens")
        n = len(p_ids)
        self._check_fits(n + sum(map(len, c_ids)), "the prompt plus all candidates")
        tokens, positions, segments = list(p_ids), list(range(n)), [0] * n
        rows, targets = [n - 1], []  # logits rows predicting each candidate token
        for seg, ids in enumerate(c_ids, start=1):
            first = len(tokens)
            tokens += ids
            positions += range(n, n + len(ids))
            segments += [seg] * len(ids)
            targets.append([(0 if j == 0 else len(rows) + j - 1, t) for j, t in enumerate(ids)])
            rows += range(first, first + len(ids) - 1)
        logprob = {}  # (index into rows, token) -> log-probability
        with timings.phase("prompt_eval"):
            for wanted, logits in self._passes(Batch(tokens, positions, segments, 0), rows):
                local = {r: i for i, r in enumerate(wanted)}
                pairs = [(r, t) for tgt in targets for r, t in tgt if r in local]
                logprob.update(zip(pairs, self.ops.token_logprobs(logits, [(local[r], t) for r, t in pairs])))
                del logits  # a device backend reuses its buffer in the next pass
        timings.mark("first_token")
        scores = [sum(logprob[r, t] for r, t in tgt) for tgt in targets]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        probs = [w / total for w in weights]
        entropy = -sum(p * math.log(p) for p in probs if p > 0)
        result = [Candidate(i, candidates[i], c_ids[i], scores[i], probs[i]) for i in range(len(candidates))]
        timings.mark("total")
        return System1Result(result, max(range(len(scores)), key=scores.__getitem__), entropy, n, timings.phases)


def _find_stop(text: str, stop: tuple[str, ...], emitted: int) -> int | None:
    """Index where the earliest stop string begins, searching only text not yet emitted."""
    hits = [i for s in stop if (i := text.find(s, max(0, emitted - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that could still grow into a stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
