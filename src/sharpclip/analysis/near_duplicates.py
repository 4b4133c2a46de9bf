"""Near-duplicate caption pairs (HN-CLIP Fig. A1–A4): which captions a text encoder finds almost the same, and which
words tell them apart.

Of a dataset's L2-normalised caption embeddings T (N, D) and its captions:

- `most_similar_pairs(text, top, text_ids)`: the `top` unordered pairs {i, j}, i ≠ j, of highest cosine tᵢ·tⱼ,
  found chunk by chunk (the N × N matrix is never held: memory O(chunk_size × N)); pairs of exactly the same caption
  text (equal `text_ids`, see `text_ids`) carry no differing word and are left out (and counted by `same_text_pairs`);
- `typical_pairs(text, quantile, count, text_ids)`: as HN-CLIP draws its Fig. A1–A4 queries "near the 90th
  percentile of the hardest-companion distribution, i.e. striking but not extreme": the `count` captions whose
  hardest companion (of another text) has the cosine nearest that quantile, each with that companion;
- `word_diff(a, b)`: both captions as word runs, each run marked when it is not in the other caption (difflib's
  longest matching blocks over word tokens, punctuation its own token);
- `pairs_markdown` / `pairs_html`: the lists with the differing words in bold (markdown) or `<mark>` (HTML). Every
  caption is escaped (markdown's table and emphasis characters; HTML through html.escape); the HTML page is one
  self-contained file with an inline style sheet and nothing fetched.
"""

from __future__ import annotations

import difflib
import html
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sharpclip.analysis.pages import Markup, Page

_WORD = re.compile(r"\w+(?:['’]\w+)*|[^\w\s]")
_MD_SPECIAL = re.compile(r"([\\`*_\[\]|<>#])")


@dataclass(frozen=True)
class CaptionPair:
    """Two captions (indices into the dataset's list) and their cosine under the text encoder."""

    i: int
    j: int
    cosine: float


def text_ids(captions: Sequence[str]) -> Tensor:
    """(N,) one id per distinct caption text (whitespace runs count as one space): equal ids, identical captions."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(" ".join(c.split()), len(ids)) for c in captions], dtype=torch.long)


def same_text_pairs(ids: Tensor) -> int:
    """How many unordered pairs share a caption text: Σ c·(c − 1) / 2 over each text's count c."""
    counts = torch.bincount(ids)
    return int((counts * (counts - 1) // 2).sum())


def most_similar_pairs(text: Tensor, top: int, ids: Tensor | None = None, chunk_size: int = 1024) -> list[CaptionPair]:
    """The `top` unordered pairs of highest cosine, highest first (ties: lower i, then lower j), leaving out pairs
    of equal `ids` (text_ids). text: (N, D) L2-normalised."""
    n = text.shape[0]
    ids = torch.arange(n) if ids is None else ids
    best_v, best_i = torch.empty(0), torch.empty(0, dtype=torch.long)
    for start in range(0, n, chunk_size):
        g = text[start : start + chunk_size].float() @ text.float().t()
        rows = torch.arange(start, start + g.shape[0])
        g[rows[:, None] >= torch.arange(n)[None, :]] = float("-inf")  # j > i only: each unordered pair once
        g[ids[rows][:, None] == ids[None, :]] = float("-inf")  # the same text: no word differs
        k = min(top, g.numel())
        v, flat = g.flatten().topk(k)
        keep = v > float("-inf")
        pair_ids = rows[flat // n] * n + flat % n
        best_v, best_i = torch.cat([best_v, v[keep]]), torch.cat([best_i, pair_ids[keep]])
        order = sorted(range(len(best_v)), key=lambda t: (-float(best_v[t]), int(best_i[t])))[:top]
        best_v, best_i = best_v[order], best_i[order]
    return [CaptionPair(int(p) // n, int(p) % n, float(v)) for v, p in zip(best_v, best_i, strict=True)]


def hardest_companions(text: Tensor, ids: Tensor | None = None, chunk_size: int = 1024) -> tuple[Tensor, Tensor]:
    """Each caption's most similar caption of another text (`ids`; None: any other row): (cosines (N,), indices
    (N,)); -inf and an arbitrary index for a caption with no other text. text: (N, D), N ≥ 2."""
    ids = torch.arange(text.shape[0]) if ids is None else ids
    values, index = [], []
    for start in range(0, text.shape[0], chunk_size):
        g = text[start : start + chunk_size].float() @ text.float().t()
        rows = torch.arange(start, start + g.shape[0])
        g[ids[rows][:, None] == ids[None, :]] = float("-inf")  # not itself, nor a copy of its text
        v, i = g.max(1)
        values.append(v)
        index.append(i)
    return torch.cat(values), torch.cat(index)


def typical_pairs(text: Tensor, quantile: float = 0.9, count: int = 10, ids: Tensor | None = None) -> list[CaptionPair]:
    """The `count` captions whose hardest companion's cosine (of another text: `ids`) is nearest the `quantile` of
    all hardest cosines, each with that companion (HN-CLIP Fig. A1–A4's selection; a pair two captions share is
    listed once), in decreasing cosine."""
    values, index = hardest_companions(text, ids)
    found = values > float("-inf")
    if not bool(found.any()):
        return []
    target = torch.quantile(values[found].double(), quantile).float()
    gap = torch.where(found, (values - target).abs(), torch.full_like(values, float("inf")))
    pairs: list[CaptionPair] = []
    seen: set[frozenset[int]] = set()
    for i in gap.argsort(stable=True)[: int(found.sum())].tolist():  # nearest first; each unordered pair once
        pair = frozenset((i, int(index[i])))
        if pair not in seen and len(pairs) < count:
            seen.add(pair)
            pairs.append(CaptionPair(i, int(index[i]), float(values[i])))
    return sorted(pairs, key=lambda p: (-p.cosine, p.i))


def _tokens(text: str) -> list[tuple[str, bool]]:
    """(word or punctuation token, whether whitespace precedes it in `text`)."""
    return [(m.group(), m.start() > 0 and text[m.start() - 1].isspace()) for m in _WORD.finditer(text)]


Run = tuple[str, bool, bool]  # (token, differs from the other caption, whitespace before it)


def word_diff(a: str, b: str) -> tuple[list[Run], list[Run]]:
    """Both captions as lists of (token, differs, spaced) runs: `differs` marks a token outside the longest common
    token blocks of the two captions (difflib.SequenceMatcher over word and punctuation tokens, no junk heuristic);
    `spaced`: whitespace precedes it in the caption (to write it back as it was)."""
    ta, tb = _tokens(a), _tokens(b)
    same_a, same_b = [False] * len(ta), [False] * len(tb)
    matcher = difflib.SequenceMatcher(None, [t for t, _ in ta], [t for t, _ in tb], autojunk=False)
    for block in matcher.get_matching_blocks():
        same_a[block.a : block.a + block.size] = [True] * block.size
        same_b[block.b : block.b + block.size] = [True] * block.size
    return (
        [(t, not same, sp) for (t, sp), same in zip(ta, same_a, strict=True)],
        [(t, not same, sp) for (t, sp), same in zip(tb, same_b, strict=True)],
    )


def render(runs: list[Run], escape: Callable[[str], str], mark: tuple[str, str]) -> str:
    """The caption written back from its runs, each stretch of differing tokens wrapped in `mark` (open, close)
    and every piece of text passed through `escape`."""
    out, k = "", 0
    while k < len(runs):
        end = k + 1
        while end < len(runs) and runs[end][1] == runs[k][1]:
            end += 1
        text = "".join((" " if sp and i > k else "") + t for i, (t, _, sp) in enumerate(runs[k:end], start=k))
        text = escape(text)
        out += (" " if runs[k][2] and out else "") + (f"{mark[0]}{text}{mark[1]}" if runs[k][1] else text)
        k = end
    return out


def cosine_text(value: float) -> str:
    """A cosine to 4 decimals, or to 6 when it would round to 1.0000 (two different texts are rarely exactly 1)."""
    return f"{value:.4f}" if value < 0.99995 else f"{value:.6f}"


def md_escape(text: str) -> str:
    """`text` safe inside a markdown table cell: markdown's emphasis, link, table and html characters escaped."""
    return _MD_SPECIAL.sub(r"\\\1", " ".join(text.split()))


def caption_pairs(pairs: Sequence[CaptionPair], captions: Sequence[str]) -> list[dict[str, Any]]:
    """JSON-ready rows {"i", "j", "cosine", "a", "b", "differ_a", "differ_b"} (each side's differing words)."""
    rows = []
    for p in pairs:
        da, db = word_diff(captions[p.i], captions[p.j])
        rows.append({
            "i": p.i, "j": p.j, "cosine": p.cosine, "a": captions[p.i], "b": captions[p.j],
            "differ_a": [t for t, d, _ in da if d], "differ_b": [t for t, d, _ in db if d],
        })  # fmt: skip
    return rows


def pairs_markdown(sections: dict[str, dict[str, Any]]) -> str:
    """Per dataset and list (sections[name] = {"most_similar": rows, "typical": rows, "same_text": n, "quantile"}):
    a table of cosine and both captions, the differing words in bold."""
    lines = ["# Near-duplicate caption pairs", ""]
    for name, s in sections.items():
        lines += [f"## {md_escape(name)}", ""]
        for key, title in _titles(s).items():
            lines += [f"### {title}", "", "| # | cosine | caption | nearest other caption |", "|---|---|---|---|"]
            for n, r in enumerate(s[key], 1):
                da, db = word_diff(r["a"], r["b"])
                cells = [render(side, md_escape, ("**", "**")) for side in (da, db)]
                lines.append(f"| {n} ({r['i']}, {r['j']}) | {cosine_text(r['cosine'])} | {cells[0]} | {cells[1]} |")
            lines.append("")
    return "\n".join(lines)


def _titles(s: dict[str, Any]) -> dict[str, str]:
    same = f"; {s['same_text']} pairs of identical text left out" if s["same_text"] else ""
    return {
        "most_similar": f"Most similar pairs (highest cosine first{same})",
        "typical": f"Typical near-duplicates: captions whose hardest companion sits nearest its "
        f"{100 * s['quantile']:.0f}th percentile (HN-CLIP Fig. A1–A4)",
    }


def pairs_html(sections: dict[str, dict[str, Any]], title: str = "Near-duplicate caption pairs") -> str:
    """The same lists as one self-contained HTML page (analysis.pages: inline style, no scripts, nothing fetched),
    captions escaped and the differing words in <mark>."""
    page = Page(Path("near_duplicates.html"), title)
    for name, s in sections.items():
        page.heading(name)
        for key, heading in _titles(s).items():
            page.heading(heading, level=3)
            rows = []
            for n, r in enumerate(s[key], 1):
                sides = word_diff(r["a"], r["b"])
                marked = [Markup(render(side, html.escape, ("<mark>", "</mark>"))) for side in sides]
                rows.append([f"{n} ({r['i']}, {r['j']})", cosine_text(r["cosine"]), *marked])
            page.add(page.table(["#", "cosine", "caption", "nearest other caption"], rows))
    return page.render()


def near_duplicate_sections(
    text: Tensor, captions: Sequence[str], top: int = 20, quantile: float = 0.9
) -> dict[str, Any]:
    """One dataset's section: its `top` most similar pairs and `top` typical ones of different texts (module doc),
    and how many pairs of identical text were left out. text: (N, D) L2-normalised, row i = captions[i]."""
    ids = text_ids(captions)
    return {
        "most_similar": caption_pairs(most_similar_pairs(text, top, ids), captions),
        "typical": caption_pairs(typical_pairs(text, quantile, top, ids), captions),
        "same_text": same_text_pairs(ids),
        "quantile": quantile,
    }
