"""Texts for tokenizer comparisons: hand-picked hard cases plus seeded random Unicode."""
from __future__ import annotations

import random
import unicodedata

FIXED = [
    "",
    "Hello world",
    " Hello World!  How's it going? I'M FINE, you'RE 'll 'd 'Ve",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\r\n",
    "if (a<=b && c!=d) { printf(\"%d\\n\", a->b[3]); }",
    "我想在apple工作1314151天～ 日本語のテキスト、カタカナ。한국어 문장입니다.",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 👨‍👩‍👧‍👦🏳️‍🌈",
    "3 33 333 3333 12345678901234567890 3.14159 1,000,000 ٣٤٥ ½ Ⅻ",
    "   leading spaces\t\t\ttabs\n\n\n\nnewlines \r\n\r\n   \t \n mixed  \u00a0nbsp\u3000ideographic\u2028ls",
    " " * 40 + "\t" * 7 + "\n" * 9 + " \n \n\t",
    "trailing spaces   ",
    "e\u0301 a\u0300\u0316 \u0915\u094d\u0937 combining Z\u0351\u0367\u0313a\u0345\u0318l\u0316g\u034fo\u0315",
    "שלום עולם مرحبا بالعالم \u200f\u202bRTL\u202c",
    "Ünïcödé ÀÉÎÕÜ ſ 'ſ it'ſelf x'ſo IT'S it'Ş 'T K Ω µ ﬁ ß",
    b"invalid \xff\xfe utf8 \xe2\x82 cut \xf0\x9f\x98".decode("utf-8", "replace"),
    "control \x00\x01\x1c\x1d\x1e\x1f\x7f\x85 chars",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>text<|im_end|",
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nx<|eot_id|>",
    "<s> </s> <unk> [INST] tokens",
    "Привет, мир! Ελληνικά. Ṫḧïṡ ïṡ ẅëïṙḋ.",
    "http://example.com/path?q=1&r=2#frag user@mail.org $100 +5 <tag attr='v'>",
]

_RANGES = [
    (0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x5FF),
    (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F),
    (0x2070, 0x22FF), (0x2460, 0x27BF), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
    (0xFF00, 0xFFEF), (0x1F300, 0x1F6FF), (0x1F900, 0x1F9FF), (0x10400, 0x1044F), (0x1D400, 0x1D7FF),
]


def random_texts(n: int = 120, seed: int = 1234) -> list[str]:
    """Mixed-script strings. Only code points assigned in the running Python's Unicode data
    (Cn and surrogates excluded): newer ones may be categorised differently by Oniguruma/Rust."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 60)):
            if rng.random() < 0.25:
                chars.append(rng.choice(" \t\n\r  '0123456789"))
                continue
            lo, hi = rng.choice(_RANGES)
            c = chr(rng.randint(lo, hi))
            if unicodedata.category(c) not in ("Cn", "Cs"):
                chars.append(c)
        out.append("".join(chars))
    return out


def corpus() -> list[str]:
    return FIXED + random_texts()
