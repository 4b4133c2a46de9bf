"""Caption text cleaning before tokenisation, as the reference tokenizers do it.

OpenAI CLIP's `SimpleTokenizer.encode`, open_clip's `SimpleTokenizer` and Long-CLIP's copy of it clean every caption
before byte-pair encoding: `ftfy.fix_text` (typographic quotes become ASCII ones, ligatures are split, mojibake is
repaired), `html.unescape` applied twice ("&amp;amp;" becomes "&"), then runs of whitespace collapse to one space
and the ends are stripped (lowercasing follows, which the HF CLIP tokenizer's normaliser also does).
transformers' `CLIPTokenizer` skips the first two steps, so without this cleaning "encoder’s" and "&amp;" tokenise
differently from the checkpoints' own tokenizer. The cleaning belongs to the OpenAI BPE vocabulary (CLIP, Long-CLIP
and their stretched or RoPE derivatives); SigLIP's sentencepiece tokenizers do not clean, so neither does sharpclip.
"""

from __future__ import annotations

import html
import re
import unicodedata
from collections.abc import Callable
from typing import Any

import ftfy

from sharpclip.data.ignorable import is_default_ignorable

CLIP_CLEANING = "clip: ftfy.fix_text, html.unescape twice, whitespace collapsed"
NO_CLEANING = "none"
# Text that ftfy and html.unescape both leave unchanged: printable ASCII and ordinary whitespace, no '&'.
_UNTOUCHED = re.compile(r"[\t\n\r\x20-\x25\x27-\x7e]*")


def is_blank(text: str) -> bool:
    """Whether `text` shows nothing: only Unicode whitespace (str.isspace: spaces, tabs, U+00A0, U+3000, ...) and
    characters of Unicode's Default_Ignorable_Code_Point set (zero-width space U+200B, joiners, word joiner U+2060,
    byte-order mark U+FEFF, soft hyphen, bidi controls, the Hangul fillers U+3164 / U+115F / U+1160 / U+FFA0, the
    combining grapheme joiner U+034F, variation selectors, tags: data.ignorable) and control characters (category Cc:
    NUL, U+0001..U+001F, DEL, the C1 controls; a renderer draws none, and CLIP's cleaning drops them). Such a caption
    is an empty caption."""
    return all(c.isspace() or is_default_ignorable(c) or unicodedata.category(c) == "Cc" for c in text)


def clip_clean(text: str) -> str:
    """`text` cleaned as OpenAI CLIP / open_clip do before BPE (without their final lowercasing)."""
    if _UNTOUCHED.fullmatch(text) is None:  # the fast path gives the same result; ftfy costs ~50 µs a caption
        text = html.unescape(html.unescape(ftfy.fix_text(text)))
    return " ".join(text.split())


def uses_clip_cleaning(tokenizer: Any) -> bool:
    """True for OpenAI-vocabulary tokenizers (transformers' `CLIPTokenizer`, hence CLIP, Long-CLIP and their
    derivatives, and sharpclip's word tokenizer built on it); False for SigLIP's and any other."""
    from transformers import CLIPTokenizer  # heavy; the data layer needs it only to recognise a tokenizer

    return isinstance(tokenizer, CLIPTokenizer)


def cleaning_for(tokenizer: Any) -> tuple[Callable[[str], str] | None, str]:
    """(the cleaning function or None, its description for the eval manifest) for `tokenizer`."""
    return (clip_clean, CLIP_CLEANING) if uses_clip_cleaning(tokenizer) else (None, NO_CLEANING)
