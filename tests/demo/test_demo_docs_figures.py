"""The docs' demo figures are the code's: the seed-0 figures of `sharpclip demo` pinned in
tests/fixtures/demo_headline.json (measured, with the command) are the ones README-linked docs/reproduction.md quotes.
The quick demo's own figures, from the same fixture, are checked where the suite runs it (test_demo_quick.py)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINNED = json.loads((ROOT / "tests" / "fixtures" / "demo_headline.json").read_text())
RERUN = ("rerun `sharpclip demo` (from an empty cache), update README.md and docs/reproduction.md, and bless the new "
         "figures in tests/fixtures/demo_headline.json in the same change")  # fmt: skip


def test_the_reproduction_page_quotes_the_pinned_default_demo():
    default = PINNED["default"]["figures"]
    page = " ".join((ROOT / "docs" / "reproduction.md").read_text().split())  # line breaks as spaces
    init, infonce, hn = default["init"], default["infonce"], default["hn"]
    quoted = [
        f"The init: mean R@1 {init['mean_R@1']:.1f}, within-family {init['within_mean_R@1']:.1f} (stage A2, seed 0)",
        f"infonce: α = 1 target {infonce['mean_R@1']:.1f}",
        f"hn: α = 1 target {hn['mean_R@1']:.1f}",
        f"InfoNCE (seed 0) {infonce['mean_R@1']:.1f} / {infonce['within_mean_R@1']:.1f}",
        f"HN-CLIP γ 0.5 (seed 0) {hn['mean_R@1']:.1f} / {hn['within_mean_R@1']:.1f}",
    ]
    for text in quoted:
        assert text in page, f"docs/reproduction.md no longer says {text!r}: {RERUN}"
