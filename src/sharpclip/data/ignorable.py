"""Unicode's Default_Ignorable_Code_Point property as data: the characters a renderer shows as nothing.

Python's `unicodedata` does not carry this property, so its ranges are written out here, from the Unicode Character
Database file DerivedCoreProperties.txt, property Default_Ignorable_Code_Point, Unicode 16.0.0 (4,174 code points;
the ranges are the same in 14.0, 15.0 and 15.1). Besides the format characters (zero-width space, joiners, bidi
controls, BOM, soft hyphen, tags) it holds characters of other categories that show nothing: the Hangul fillers
U+115F, U+1160, U+3164 and U+FFA0 (Lo), the combining grapheme joiner U+034F and the variation selectors (Mn).
"""

from __future__ import annotations

import bisect

# (first, last) code points, inclusive, in order: DerivedCoreProperties.txt, Default_Ignorable_Code_Point, 16.0.0
DEFAULT_IGNORABLE_RANGES: tuple[tuple[int, int], ...] = (
    (0x00AD, 0x00AD),  # SOFT HYPHEN
    (0x034F, 0x034F),  # COMBINING GRAPHEME JOINER
    (0x061C, 0x061C),  # ARABIC LETTER MARK
    (0x115F, 0x1160),  # HANGUL CHOSEONG FILLER..HANGUL JUNGSEONG FILLER
    (0x17B4, 0x17B5),  # KHMER VOWEL INHERENT AQ..KHMER VOWEL INHERENT AA
    (0x180B, 0x180F),  # MONGOLIAN FREE VARIATION SELECTORS, VOWEL SEPARATOR (U+180E)
    (0x200B, 0x200F),  # ZERO WIDTH SPACE..RIGHT-TO-LEFT MARK
    (0x202A, 0x202E),  # LEFT-TO-RIGHT EMBEDDING..RIGHT-TO-LEFT OVERRIDE
    (0x2060, 0x206F),  # WORD JOINER..NOMINAL DIGIT SHAPES (the isolates U+2066..U+2069 among them)
    (0x3164, 0x3164),  # HANGUL FILLER
    (0xFE00, 0xFE0F),  # VARIATION SELECTOR-1..VARIATION SELECTOR-16
    (0xFEFF, 0xFEFF),  # ZERO WIDTH NO-BREAK SPACE (byte-order mark)
    (0xFFA0, 0xFFA0),  # HALFWIDTH HANGUL FILLER
    (0xFFF0, 0xFFF8),  # reserved
    (0x1BCA0, 0x1BCA3),  # SHORTHAND FORMAT LETTER OVERLAP..SHORTHAND FORMAT UP STEP
    (0x1D173, 0x1D17A),  # MUSICAL SYMBOL BEGIN BEAM..MUSICAL SYMBOL END PHRASE
    (0xE0000, 0xE0FFF),  # tags, variation selectors supplement, reserved
)
_FIRSTS = [first for first, _ in DEFAULT_IGNORABLE_RANGES]


def is_default_ignorable(char: str) -> bool:
    """Whether the one character `char` has Unicode's Default_Ignorable_Code_Point property."""
    code = ord(char)
    i = bisect.bisect_right(_FIRSTS, code) - 1
    return i >= 0 and code <= DEFAULT_IGNORABLE_RANGES[i][1]
