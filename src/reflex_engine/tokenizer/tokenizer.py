"""The Tokenizer: special-token partition, BPE/SPM encode, decode and streaming decode.

Standard library only (cold path). Text comes in as `str`; a caller holding bytes that may
be invalid UTF-8 decodes them with errors="replace" first (lone surrogates in a str are
replaced by U+FFFD here, since they have no UTF-8 form).

Behaviour choices, where llama.cpp and HF tokenizers differ or llama.cpp has options:
- Special tokens in text are matched leftmost-longest, as HF's added-token matcher does
  (llama.cpp's tokenizer_st_partition tries the longest token text first over the whole
  text; the two differ only when two special texts overlap). parse_special=True matches
  CONTROL, USER_DEFINED and UNKNOWN tokens; parse_special=False only USER_DEFINED.
- decode() concatenates token bytes and skips CONTROL/UNKNOWN tokens unless special=True
  (llama.cpp's token_to_piece(special=false)); UNUSED/UNDEFINED tokens decode to nothing.
  It does not apply llama.cpp's clean_spaces pass (" ," -> ","), which is lossy and cannot
  stream. For SPM with add_space_prefix, one leading space of the first token is dropped,
  as llama.cpp's detokenize does, so decode(encode(s, add_bos=False)) == s.
"""
from __future__ import annotations

import codecs
import re

from ..errors import ReflexError
from .bpe import BPE, UNICODE_TO_BYTE
from .pretokenize import PreTokenizer
from .special import SpecialMatcher
from .spm import SPM
from .vocab import BYTE, BYTE_TEXT, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Vocab

_SILENT = frozenset({CONTROL, UNKNOWN})  # decoded only with special=True


class Tokenizer:
    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.kind = vocab.kind
        self.pre = vocab.pre
        self.n_vocab = len(vocab.tokens)
        self.bos_id = vocab.bos_id
        self.eos_id = vocab.eos_id
        self.eog_ids = frozenset(vocab.eog_ids)
        self.add_bos = vocab.add_bos
        if self.kind == "bpe":
            self._pre = PreTokenizer(vocab.pre if vocab.pre is not None else "default")
            self._bpe = BPE(vocab.tokens, vocab.merges, vocab.ignore_merges)
        else:
            self._spm = SPM(vocab.tokens, vocab.scores, vocab.unk_id)
        self._specials: dict[bool, SpecialMatcher | None] = {}
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def from_gguf(cls, gguf_file, use_cache: bool = True) -> Tokenizer:
        from .cache import load_vocab_cached

        return cls(load_vocab_cached(gguf_file, use_cache))

    # -- encode -----------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`.

        add_bos=None follows the file (BOS if add_bos_token, EOS if add_eos_token); True
        forces BOS; False adds no special token at all (llama.cpp's add_special=false).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        out: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ReflexError("tokenizer: BOS requested but the vocabulary has no BOS token")
            out.append(self.bos_id)
        prev_special = True
        for fragment, special_id in self._partition(text, parse_special):
            if special_id is not None:
                out.append(special_id)
                prev_special = True
                continue
            if self.kind == "bpe":
                encode_piece = self._bpe.encode_piece
                for piece in self._pre.split(fragment):
                    encode_piece(piece, out)
            else:
                # llama.cpp: a space is prefixed at the start and after every special token
                if self.vocab.add_space_prefix and prev_special:
                    fragment = " " + fragment
                self._spm.encode(fragment.replace(" ", "\u2581"), out)
            prev_special = False
        if self.vocab.add_eos and add_bos is not False and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool):
        """Yields (text, None) for plain fragments and ("", id) for special tokens."""
        matcher = self._special_matcher(parse_special)
        if matcher is not None:
            yield from matcher.partition(text)
        elif text:
            yield text, None

    def _special_matcher(self, parse_special: bool) -> SpecialMatcher | None:
        if parse_special not in self._specials:
            kinds = bytes([CONTROL, USER_DEFINED, UNKNOWN] if parse_special else [USER_DEFINED])
            # a C-level scan of the type bytes: no Python loop over the 150k ids
            found = (m.start() for m in re.finditer(b"[%s]" % re.escape(kinds), self.vocab.types))
            ids = {self.vocab.tokens[i]: i for i in found}
            ids.pop("", None)  # only a damaged table has an empty text
            self._specials[parse_special] = SpecialMatcher(ids) if ids else None
        return self._specials[parse_special]

    # -- decode -----------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (control tokens: their text)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            if not 0 <= token_id < self.n_vocab:
                raise ReflexError(f"tokenizer: token id {token_id} is out of range (vocabulary has {self.n_vocab})")
            piece = self._pieces[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> bytes:
        text, ttype = self.vocab.tokens[token_id], self.vocab.types[token_id]
        if ttype in _SILENT or ttype == USER_DEFINED:
            return text.encode("utf-8")
        if ttype == BYTE and (self.kind == "spm" or text.startswith("<0x")):
            if not BYTE_TEXT.match(text):  # load_vocab refuses these; a prepared table is not re-checked
                raise ReflexError(f"tokenizer: byte token {token_id} is {text[:40]!r}, not '<0xHH>'")
            return bytes([int(text[3:5], 16)])
        if ttype == BYTE:
            return text.encode("utf-8")
        if ttype != NORMAL:
            return b""
        if self.kind == "spm":
            return text.replace("\u2581", " ").encode("utf-8")
        # a character outside GPT-2's byte table stands for its own UTF-8 (as HF's ByteLevel decoder)
        return b"".join(bytes([UNICODE_TO_BYTE[c]]) if c in UNICODE_TO_BYTE else c.encode("utf-8") for c in text)

    def _visible_bytes(self, token_id: int, special: bool, first: bool) -> bytes:
        piece = self.token_bytes(token_id)  # first: it refuses an id out of range
        if not special and self.vocab.types[token_id] in _SILENT:
            return b""
        if first and self.kind == "spm" and self.vocab.add_space_prefix and piece.startswith(b" "):
            piece = piece[1:]
        return piece

    def decode(self, ids, special: bool = False) -> str:
        """Text of `ids`; incomplete or invalid UTF-8 becomes U+FFFD."""
        data = b"".join(self._visible_bytes(t, special, i == 0) for i, t in enumerate(ids))
        return data.decode("utf-8", "replace")

    def stream(self, special: bool = False, continuation: bool = True) -> StreamDecoder:
        """continuation: the ids follow earlier text (a prompt), so no leading space is dropped."""
        return StreamDecoder(self, special, first=not continuation)


class StreamDecoder:
    """Decodes one id at a time, returning only complete characters.

    A multi-byte character split over several tokens is held until its last byte arrives;
    flush() returns what is left (an incomplete tail as U+FFFD). With first=True the
    concatenation of all feed() results and flush() equals tokenizer.decode(ids, special).
    """

    def __init__(self, tokenizer: Tokenizer, special: bool, first: bool):
        self._tok = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._first = first

    def feed(self, token_id: int) -> str:
        piece = self._tok._visible_bytes(token_id, self._special, self._first)
        self._first = False
        return self._utf8.decode(piece)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
