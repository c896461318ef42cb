"""Where file, architecture and backend meet: open a model, evaluate batches, generate, score.

ModelFile is the host-side half (GGUF, architecture config, tokenizer) and imports no numpy,
so a caller can open the file and encode the prompt before any backend exists. Model adds
a backend and the weights on it.
"""
from __future__ import annotations

import math
import os
import time
import weakref
from functools import cached_property
from typing import Any, Iterator, Mapping, NamedTuple, Sequence, Union

from . import kvstate, lora  # stdlib only; imported here, beside the driver's init, not after it
from .arch import get_arch
from .arch.weights import load_weights, plan_weights
from .backends import BackendStart, started
from .errors import ContextExceeded, ReflexError
from .gguf import GGUFFile
from .ops import SAMPLED, Batch
from .timing import Timings
from .tokenizer import Tokenizer

# Text, token ids (no BOS added), or chat messages (rendered with the model's chat template).
Prompt = Union[str, Sequence[int], Sequence[Mapping[str, Any]]]
MAX_TOP_LOGPROBS = 20  # as OpenAI's API


class ModelFile:
    """A GGUF model opened on the host: metadata, architecture config, tokenizer."""

    adapters: tuple = ()  # LoRA adapters (lora.Adapter) load() applies, in add_lora's order

    def __init__(self, path: str, timings: Timings | None = None):
        self.timings = timings or Timings()
        with self.timings.phase("gguf_open"):
            self.gguf = GGUFFile(path)
            meta = self.gguf.metadata
            self.arch = get_arch(meta.get("general.architecture"))
            self.config = self.arch.config(meta)
        with self.timings.phase("tokenizer"):
            self.tokenizer = Tokenizer.from_gguf(self.gguf)
            self.gguf.check_unchanged()
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

    def add_lora(self, path: str, scale: float = 1.0) -> None:
        """Apply a LoRA adapter (llama.cpp's convert_lora_to_gguf.py format) at load, its update
        scaled by `scale`; checked against this model now (a one-line error for another base)."""
        plan = plan_weights(self.gguf, self.config, self.arch.TENSORS, self.arch.LAYER_TENSORS)
        self.adapters = self.adapters + (lora.Adapter(path, scale, self.gguf, self.config, plan),)

    def load(self, device: str | BackendStart = "auto", n_ctx: int | None = None) -> Model:
        """The model on a backend: a device name, or a BackendStart begun before this file was
        opened (its driver init then ran beside the host work)."""
        if n_ctx is not None and n_ctx < 1:
            raise ReflexError(f"the context size must be at least 1 token, not {n_ctx}")
        c, arch = self.config, self.arch
        # host work, before the wait for the driver's init (whose thread the CLI started at launch), and a
        # file that lacks a tensor is refused before a backend is started here
        plan = plan_weights(self.gguf, c, arch.TENSORS, arch.LAYER_TENSORS)
        start = started(device)
        with self.timings.phase("backend_init"):  # what the init thread did not hide
            cpu_only = None if "cuda" in self.arch.BACKENDS else f"{self.config.arch} runs on the CPU backend for now: use --device cpu"
            ops = start.ops(cpu_only)
        if start.cuda_init_ms is not None:
            self.timings.phases.update(cuda_start_ms=start.started_ms, cuda_init_ms=start.cuda_init_ms,
                                       cuda_ready_ms=start.ready_ms)
            self.timings.phases["cuda_init_hidden_ms"] = max(0.0, start.cuda_init_ms - self.timings.phases["backend_init_ms"])
        n_ctx = n_ctx or self.config.n_ctx_train
        with self.timings.phase("model_load"):
            shape = c.cache_shape(n_ctx)
            tensors = [(t.ggml_type, t.shape) for t in plan.values() if t is not None] + lora.device_tensors(self.adapters)
            with self.timings.phase("reserve"):  # model_load's share spent taking the device's memory
                ops.reserve(tensors, shape, c.activation_width + lora.extra_width(self.adapters))
            weights = load_weights(self.gguf, c, plan, arch.TENSORS, arch.LAYER_TENSORS, ops)
            lora.apply(self.adapters, weights, ops)
            uploaded = ops.commit_weights()  # a device backend's copies run on beside the first pass
            cache = ops.new_kv_cache(shape)
            self.gguf.check_unchanged()  # the weights just read are this file's, not a rewrite's
        return Model(self, ops, weights, cache, n_ctx, uploaded)


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
        self.cached_tokens = 0  # of prompt_tokens, those an imported or baked KV state held
        self._events: Iterator[TokenEvent] = iter(())
        self._cancelled = False
        self._context: tuple[list[int], int] | None = None  # at the end: the evaluated tokens, the last choice

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
    cached_tokens: int = 0  # of prompt_tokens, those an imported or baked KV state held


def _release(forward, ops) -> None:
    """Best effort, also from a finalizer: a device already failed (its context lost after an error)
    refuses the frees, and the driver gives everything back at the process's exit."""
    for part in (forward, ops):  # the captured passes first: they live in the ops' memory
        close = getattr(part, "close", None)
        if close is not None:
            try:
                close()
            except ReflexError:
                pass


class ClosedOps:
    """A closed model's backend: every use is refused."""

    def __getattr__(self, name: str):
        raise ReflexError("this model was closed: load it again")


class Model:
    """A model on a backend. One request at a time: every request reuses the one KV cache."""

    def __init__(self, file: ModelFile, ops, weights, cache, n_ctx: int, uploaded: int = 0):
        self.file, self.ops, self.weights, self.cache, self.n_ctx = file, ops, weights, cache, n_ctx
        self.uploaded = uploaded  # bytes of weights the backend copies to its device
        self.config, self.tokenizer = file.config, file.tokenizer
        # a forward pass: every decode step, and every prompt of one length at one slot, makes the same
        # launches, which a device backend may capture once
        self._forward = ops.replayable(lambda batch, rows: file.arch.forward(ops, weights, file.config, cache, batch, rows))
        # the device's memory goes back with the model (or at close()), never on the way out of the
        # process: the driver releases it at exit, faster
        self._release = weakref.finalize(self, _release, self._forward, ops)
        self._release.atexit = False

    def close(self) -> None:
        """Give the backend's memory back now (CUDA: the weights, the KV cache, the buffers, the
        pinned file pages); the model takes no request after. A dropped model does it too."""
        self._release()
        self.ops = ClosedOps()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
            logits = self._forward(part, [out_rows[i] - a for i in wanted])
            if wanted:
                yield wanted, logits
            del logits  # before the next pass, so a device backend can reuse the buffer

    def _segment_passes(self, batch: Batch, out_rows: Sequence[int]) -> Iterator[tuple[list[int], object]]:
        """_passes for a batch of segments (system1's). A recurrent layer's state is one sequence's,
        so there each run of equal segments is evaluated on its own: the shared prefix (segment 0)
        first, its state checkpointed, then every candidate from that checkpoint; at the end the
        state is the prefix's again."""
        if not self.config.recurrent_layers:
            yield from self._passes(batch, out_rows)
            return
        n, segments = len(batch.tokens), batch.segments
        starts = [a for a in range(n) if a == 0 or segments[a] != segments[a - 1]]
        for a, b in zip(starts, starts[1:] + [n]):
            if segments[a]:
                self.ops.rewind_state(self.cache)
            part = Batch(batch.tokens[a:b], batch.positions[a:b], segments[a:b], batch.start + a)
            mine = [i for i, r in enumerate(out_rows) if a <= r < b]
            for wanted, logits in self._passes(part, [out_rows[i] - a for i in mine]):
                yield [mine[i] for i in wanted], logits
                del logits
            if not segments[a]:
                self.ops.checkpoint_state(self.cache)
        self.ops.rewind_state(self.cache)

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

    def _prompt_ids(self, prompt: Prompt, tools: Sequence[Mapping] | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        elif _is_chat(prompt):
            text = self.file.render_chat(list(prompt), tools=tools, **_template_variables(chat_template_kwargs))
            ids = self.tokenize(text, add_bos=False)  # the template writes its BOS
        else:
            ids = list(prompt)
        if not ids:
            raise ReflexError("the prompt is empty (it tokenizes to no tokens)")
        self._check_ids(ids)
        return ids

    # -- generate ------------------------------------------------------------------------------

    def generate(self, prompt: Prompt, max_tokens: int = 128, sampling=None, stop: Sequence[str] = (),
                 ignore_eos: bool = False, logprobs: bool = False, top_logprobs: int = 0,
                 import_kv: str | None = None, export_kv: str | None = None, constraint=None,
                 tools: Sequence[Mapping] | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> Generation:
        """Stream the continuation of `prompt` (text, token ids or chat messages) as TokenEvents.

        tools, chat_template_kwargs: with chat messages, what their template is given besides them:
        tools as transformers and OpenAI take them (`{"type": "function", "function": {...}}`), and
        template variables (e.g. `{"enable_thinking": False}`); see ModelFile.render_chat.

        logprobs: each event carries log P(token) under the model's own distribution, the
        log-softmax of its logits before penalties, temperature and the top-k/top-p/min-p filters
        (as llama.cpp's server reports them by default). top_logprobs=k (0..20) also gives the k
        likeliest tokens under that distribution, and implies logprobs. Generation.cancel() ends
        the generation at the next token boundary.

        import_kv: continue the conversation a KV state file holds; `prompt` (text without BOS,
        or ids; may be empty) is appended to it, and a seeded sampler with the file's seed
        continues the file's random stream, so the tokens equal one uninterrupted run's.
        export_kv: once the generation has been iterated to its end, write the state there
        (kvstate.py). Without import_kv, a prompt that starts with the model's baked prompt
        (`reflex prepare --system-prompt`) takes that prompt's cache instead of evaluating it.

        constraint: a constraints.Constraint (json_schema, json_object, regex, grammar) the output
        must match: every token, greedy or sampled, is chosen among those its mask allows, an
        end-of-generation token only where the grammar may end, and the generation ends when the
        grammar is complete (finish_reason "eos").
        """
        from .sampling import SamplingParams

        if max_tokens < 1 and max_tokens != -1:
            raise ReflexError("max tokens must be at least 1 (or -1: until the context is full)")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ReflexError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
        start = self._start(prompt, import_kv, tools, chat_template_kwargs)
        ids = start.ids
        self._check_fits(len(ids), "the prompt")
        if len(ids) == self.n_ctx:
            raise ContextExceeded(f"the prompt fills the whole context ({self.n_ctx} tokens) and leaves no room to generate")
        if any(not s for s in stop):
            raise ReflexError("a stop string must not be empty")
        self._check_export(export_kv)
        timings = self.file.timings.fork()
        guide = None
        if constraint is not None:
            with timings.phase("constraint"):
                guide = self._guide(constraint, ignore_eos)
        sampler = self.ops.new_sampler(sampling or SamplingParams())
        if import_kv is not None:
            sampler.restore(start.state.sampler)
        eog = frozenset() if ignore_eos else self.tokenizer.eog_ids
        self._restore(start, timings)
        gen = Generation(len(ids), timings.phases)
        gen.cached_tokens = start.cached
        n_top = top_logprobs if logprobs or top_logprobs else None
        gen._events = self._generate(gen, timings, ids, start.cached, max_tokens, sampler, tuple(stop), eog, n_top, guide)
        if export_kv is not None:
            gen._events = self._exporting(gen._events, gen, timings, sampler, export_kv)
        return gen

    def _guide(self, constraint, ignore_eos: bool):
        """The constraint compiled for this vocabulary (None without one)."""
        if constraint is None:
            return None
        if ignore_eos:
            raise ReflexError("ignore_eos and a constraint exclude each other: the grammar decides where the output ends")
        from .constraints import start

        return start(constraint, self.tokenizer, self.file.gguf)

    def _note_upload(self, timings: Timings) -> None:
        """The weights' copy ran beside the first pass; its time goes on the result line once it
        has ended. By now every weight but an untied embedding table has been read."""
        ms = self.ops.weights_arrived()
        if ms is not None and self.uploaded:
            timings.phases.update(upload_ms=ms, upload_gb_per_s=self.uploaded / 1e6 / max(ms, 1e-3))

    def _choose(self, logits, history: list[int], sampler, n_top: int | None, guide=None) -> tuple[int, tuple]:
        """The next token from logits (1, V), among those the guide (a constraint) allows, and the
        TokenEvent fields that score it: none without n_top, else its log-probability and the n_top
        likeliest tokens (None for 0)."""
        choose = sampler if guide is None else lambda rows, seen: sampler(rows, seen, mask=guide.mask())
        if n_top is None:
            return choose(logits, history), ()  # reading the choice waits for the device
        raw = self.ops.take_rows(logits, [0])  # the model's own logits: the sampler may penalize in place
        token = choose(logits, history)
        logprob = self.ops.token_logprobs(raw, [(0, token)])[0]
        if not n_top:
            return token, (logprob, None)
        top = self.ops.top_logprobs(raw, 0, n_top)
        return token, (logprob, [TokenLogprob(t, self._token_text(t), lp) for t, lp in top])

    def _generate(self, gen: Generation, timings: Timings, ids: list[int], cached: int, max_tokens: int, sampler,
                  stop: tuple[str, ...], eog, n_top: int | None, guide=None):
        capacity = self.n_ctx if max_tokens == -1 else min(self.n_ctx, len(ids) + max_tokens)
        history, n_past = list(ids), len(ids)
        # a pass may run ahead of the host's choice (_step), except into a recurrent state, which would keep it
        pipelined = guide is None and n_top is None and not self.config.recurrent_layers
        with timings.phase("prompt_eval"):
            logits = self._next_logits(Batch.causal(ids[cached:], cached))
            if guide is not None:  # the vocabulary's build ran beside the pass (a device's may still run)
                with timings.phase("constraint"):
                    guide.ready()
            # where the device chooses alone, its choice stays where a pass of SAMPLED reads it: then every decode
            # step reads its token there, the first too, and all share one shape (one CUDA graph)
            chosen = sampler.ahead(logits) if pipelined else None
            token, scored = (chosen(), ()) if chosen else self._choose(logits, history, sampler, n_top, guide)
            del logits  # the decode steps' logits take the same device buffer
        timings.mark("first_token")
        stream, text, emitted = self.tokenizer.stream(), "", 0
        ahead, sampled = None, chosen is not None
        decode_start = time.perf_counter()
        while True:
            if token in eog:
                gen.finish_reason = "eos"
                break
            gen.tokens.append(token)
            history.append(token)
            if guide is not None:
                guide.advance(token)
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
            if guide is not None and guide.done:  # nothing but the end is allowed: no pass to choose it
                gen.finish_reason = "eos"
                break
            if len(gen.tokens) == max_tokens or n_past == capacity:
                gen.finish_reason = "length"
                break
            then = len(gen.tokens) + 1 != max_tokens and n_past + 1 != capacity  # the next token's pass, unless it ends
            token, scored, ahead = self._step(token, sampled, n_past, ahead, then, pipelined, history, sampler, n_top,
                                              guide)
            n_past += 1
        if gen.finish_reason != "stop":
            text += stream.flush()
            if emitted < len(text):  # held-back text, or an unfinished character as U+FFFD
                yield TokenEvent(None, text[emitted:])
        gen.text = text
        gen._context = (history[:n_past], token)
        timings.phases["decode_ms"] = (time.perf_counter() - decode_start) * 1e3
        self._note_upload(timings)
        timings.mark("total")

    def _step(self, token: int, sampled: bool, n_past: int, ahead, then: bool, pipelined: bool, history: list[int],
              sampler, n_top: int | None, guide) -> tuple[int, tuple, object]:
        """The token after `token` (cache slot n_past), its score, and the function returning the
        token after that where its pass is queued already (`ahead`, else None). `sampled`: the device
        holds `token` where a pass of SAMPLED reads it (its sampler chose it ahead). Where the sampler
        can choose on the device alone (`pipelined`: no constraint, no scores), the next pass
        (`then`: one runs unless the chosen token ends the generation) is queued before the host
        reads the choice, reading it on the device, so the host's share of a step runs beside the
        device's. A pass queued for a token that ends the generation runs for nothing, on a slot
        past the context."""
        if ahead is None:
            logits = self._forward(Batch.causal(SAMPLED if sampled else [token], n_past), [0])
            ahead = sampler.ahead(logits) if pipelined else None
            if ahead is None:  # the logits go out of scope inside _choose: the next step's take the same device buffer
                return (*self._choose(logits, history, sampler, n_top, guide), None)
            del logits
        after = sampler.ahead(self._forward(Batch.causal(SAMPLED, n_past + 1), [0])) if then else None
        return ahead(), (), after

    # -- system1 -------------------------------------------------------------------------------

    def system1(self, prompt: Prompt, candidates: Sequence[str] | None = None, import_kv: str | None = None,
                export_kv: str | None = None, json_schema=None, tools: Sequence[Mapping] | None = None,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> System1Result:
        """Score every candidate continuation in one forward pass (see ops.Batch for the mask; a
        model with recurrent layers runs the prompt, then each candidate from its state).
        import_kv / export_kv, tools and chat_template_kwargs as for generate; the exported state
        holds the prompt alone.

        json_schema: instead of candidates, a JSON schema (a dict or JSON text) whose instances
        form a finite set of at most constraints.MAX_INSTANCES (enum, const, boolean, bounded
        integers, anyOf/oneOf, objects with additionalProperties false and bounded arrays of
        those): its instances are the candidates, as JSON text the way generate with that schema
        as a constraint writes them (constraints.schema_instances), scored as literal ones."""
        timings = self.file.timings.fork()
        if json_schema is not None:
            if candidates:
                raise ReflexError("give system1 candidates or a JSON schema of them, not both")
            from .constraints import schema_instances

            with timings.phase("constraint"):
                candidates = schema_instances(json_schema)
        if not candidates:
            raise ReflexError("system1 needs at least one candidate")
        start = self._start(prompt, import_kv, tools, chat_template_kwargs)
        p_ids = start.ids
        c_ids = [self.tokenize(c, add_bos=False) for c in candidates]
        for i, (text, ids) in enumerate(zip(candidates, c_ids)):
            if not ids:
                raise ReflexError(f"candidate {i} ({text!r}) tokenizes to no tokens")
        n = len(p_ids)
        self._check_fits(n + sum(map(len, c_ids)), "the prompt plus all candidates")
        self._check_export(export_kv)
        self._restore(start, timings)
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
        s = start.cached  # slots the imported or baked state holds: the pass starts after them
        with timings.phase("prompt_eval"):
            for wanted, logits in self._segment_passes(Batch(tokens[s:], positions[s:], segments[s:], s), [r - s for r in rows]):
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
        if export_kv is not None:
            with timings.phase("kv_export"):
                self._write_state(export_kv, p_ids, [], None)
        self._note_upload(timings)
        timings.mark("total")
        return System1Result(result, max(range(len(scores)), key=scores.__getitem__), entropy, n, timings.phases, s)

    # -- KV state files (kvstate.py) -------------------------------------------------------------

    @cached_property
    def state_fingerprint(self) -> str:
        """What a KV state file must carry to be this model's."""
        fingerprint = kvstate.model_fingerprint
        return fingerprint(self.file.gguf, [a.identity(fingerprint) for a in self.file.adapters])

    def _read_state(self, path: str):
        return kvstate.read_header(path, fingerprint=self.state_fingerprint, architecture=self.config.arch, config=self.config)

    def _start(self, prompt: Prompt, import_kv: str | None, tools=None, chat_template_kwargs=None):
        """The request's whole context and the cache slots a state file gives it (none read yet)."""
        for name, value in (("tools", tools), ("chat_template_kwargs", chat_template_kwargs)):
            if value is not None and not _is_chat(prompt):
                raise ReflexError(f"{name} goes to the chat template: give chat messages with it", field=name)
        if import_kv is None:
            ids = self._prompt_ids(prompt, tools, chat_template_kwargs)
            baked = kvstate.baked_state_path(self.file.gguf.path)
            try:  # a baked prompt from another model, or damaged, is no prompt: it costs time, never correctness
                state = self._read_state(baked) if os.path.exists(baked) else None
            except ReflexError:
                state = None
            return kvstate.prefix(state, ids, whole=bool(self.config.recurrent_layers))
        if _is_chat(prompt):
            raise ReflexError("a request that imports a KV state continues it: give the new text or token ids, not chat messages")
        state = self._read_state(import_kv)
        ids = self.tokenize(prompt, add_bos=False) if isinstance(prompt, str) else list(prompt)
        self._check_ids(ids)
        return kvstate.resume(state, ids, self.n_ctx, whole=bool(self.config.recurrent_layers))

    def _restore(self, start, timings: Timings) -> None:
        if not start.cached:
            return
        with timings.phase("kv_import"), kvstate.mapped_arrays(start.state, start.cached) as arrays:
            self.ops.import_cache(self.cache, arrays, start.cached)

    def _check_export(self, path: str | None) -> None:
        if path is not None:
            kvstate.check_writable(path)  # before the work, not after it

    def bake_prompt(self, prompt: Prompt, path: str | None = None) -> list[int]:
        """Evaluate `prompt` from slot 0 and write its state to path (default: beside the model,
        where every later request whose prompt starts with it takes it: `reflex prepare
        --system-prompt`). Returns the prompt's token ids."""
        ids = self._prompt_ids(prompt)
        self._check_fits(len(ids), "the prompt")
        path = path or kvstate.baked_state_path(self.file.gguf.path)
        self._check_export(path)
        for _ in self._passes(Batch.causal(ids, 0), []):
            pass  # no logits wanted: the cache is the product
        self._write_state(path, ids, [], None)
        return ids

    def _write_state(self, path: str, tokens: list[int], pending: list[int], sampler: dict | None) -> None:
        kvstate.write_state(path, fingerprint=self.state_fingerprint, architecture=self.config.arch, tokens=tokens,
                    pending=pending, sampler=sampler, arrays=self.ops.export_cache(self.cache, len(tokens)))

    def _exporting(self, events: Iterator[TokenEvent], gen: Generation, timings: Timings, sampler,
                   path: str) -> Iterator[TokenEvent]:
        """The generation's events; after the last, its state written to path."""
        yield from events
        tokens, last = gen._context
        with timings.phase("kv_export"):
            self._write_state(path, tokens, [last], sampler.state())
        timings.mark("total")


def _is_chat(prompt: Prompt) -> bool:
    return not isinstance(prompt, str) and len(prompt) > 0 and isinstance(prompt[0], Mapping)


def _template_variables(variables: Mapping[str, Any] | None) -> dict:
    """chat_template_kwargs as render_chat's keywords; a name it takes for itself is refused."""
    from .chat import OWN_PARAMETERS

    if variables is None:
        return {}
    if not isinstance(variables, Mapping) or not all(isinstance(name, str) for name in variables):
        raise ReflexError("chat_template_kwargs must map variable names to values", field="chat_template_kwargs")
    taken = [name for name in OWN_PARAMETERS if name in variables]
    if taken:
        raise ReflexError(f"chat_template_kwargs cannot set {', '.join(taken)}: the engine gives "
                          f"{'it' if len(taken) == 1 else 'them'} to the chat template itself",
                          field="chat_template_kwargs")
    return dict(variables)


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
