"""Near-duplicate caption pairs (HN-CLIP Fig. A1–A4): the pairs found against a brute-force ranking of the full
matrix, the words marked against hand-written diffs, the escaping of both outputs, and `analyze --geometry`'s files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _support.html_pages import check_page
from _support.tiny_files import write_captions
from sharpclip.analysis import near_duplicates as nd


def _brute_force_top(text: torch.Tensor, ids: torch.Tensor, top: int) -> list[tuple[int, int]]:
    g = (text @ text.t()).tolist()
    pairs = [(g[i][j], i, j) for i in range(len(g)) for j in range(i + 1, len(g)) if ids[i] != ids[j]]
    return [(i, j) for _, i, j in sorted(pairs, key=lambda t: (-t[0], t[1], t[2]))[:top]]


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_most_similar_pairs_equal_a_brute_force_ranking_of_the_whole_matrix(chunk):
    torch.manual_seed(0)
    text = torch.nn.functional.normalize(torch.randn(23, 5), dim=1)
    ids = torch.arange(23)
    ids[7] = ids[3]  # caption 7 has caption 3's text: never a pair
    text[7] = text[3]
    got = nd.most_similar_pairs(text, 10, ids, chunk_size=chunk)
    assert [(p.i, p.j) for p in got] == _brute_force_top(text, ids, 10)
    assert all(p.cosine == pytest.approx(float(text[p.i] @ text[p.j]), abs=1e-6) for p in got)
    assert nd.same_text_pairs(nd.text_ids(["a b", "a  b", "c", "a b"])) == 3  # three copies: 3 pairs


def test_typical_pairs_take_the_captions_nearest_the_quantile_of_hardest_companions():
    # four pairs of captions at cosines 0.5, 0.7, 0.9, 0.99 in orthogonal planes: each caption's hardest companion is
    # its partner, so the hardest cosines are each value twice; their 0.75 quantile (position 0.75 · 7 = 5.25 of the
    # sorted 8) is 0.9 + 0.25 · 0.09 = 0.9225: the 0.9 pair is nearest (0.0225 away; 0.99 is 0.0675 away)
    rows = []
    for k, c in enumerate((0.5, 0.7, 0.9, 0.99)):
        a, b = torch.zeros(8), torch.zeros(8)
        a[2 * k], b[2 * k], b[2 * k + 1] = 1.0, c, (1 - c * c) ** 0.5
        rows += [a, b]
    text = torch.stack(rows)
    values, index = nd.hardest_companions(text)
    assert index.tolist() == [1, 0, 3, 2, 5, 4, 7, 6]
    assert float(torch.quantile(values.double(), 0.75)) == pytest.approx(0.9225, abs=1e-6)
    assert [(p.i, p.j) for p in nd.typical_pairs(text, 0.75, 1)] == [(4, 5)]
    # each unordered pair once: caption 5's companion is 4, already listed; next nearest is the 0.99 pair
    assert [(p.i, p.j) for p in nd.typical_pairs(text, 0.75, 2)] == [(6, 7), (4, 5)]
    assert [(p.i, p.j) for p in nd.typical_pairs(text, 1.0, 1)] == [(6, 7)]
    assert [(p.i, p.j) for p in nd.typical_pairs(text, 0.0, 2)] == [(2, 3), (0, 1)]


def test_the_words_that_differ_are_marked_and_the_rest_written_back_as_it_was():
    a, b = nd.word_diff("A red cube, left of a small ball.", "A red cube, right of a small blue ball.")
    assert [t for t, d, _ in a if d] == ["left"] and [t for t, d, _ in b if d] == ["right", "blue"]
    md = nd.render(b, nd.md_escape, ("**", "**"))
    assert md == "A red cube, **right** of a small **blue** ball."
    assert nd.render(a, str, ("", "")) == "A red cube, left of a small ball."


def test_captions_are_escaped_in_markdown_and_html(tmp_path):
    _, b = nd.word_diff("a <b>bold</b> | pipe * star", "a <i>bold</i> | pipe * star & co")
    md = nd.render(b, nd.md_escape, ("**", "**"))
    assert "\\|" in md and "\\*" in md and "<" not in md.replace("\\<", "")
    page = nd.pairs_html({"x<y": _section("a <b>bold</b> & co", "a <i>bold</i> & co")})
    assert "<b>" not in page and "<i>" not in page and "x&lt;y" in page
    assert "a &lt;<mark>b</mark>&gt;bold&lt;/<mark>b</mark>&gt; &amp; co" in page  # the tag's name is the diff
    path = tmp_path / "pairs.html"
    path.write_text(page, encoding="utf-8")
    check_page(path)  # structure, nothing remote


def _section(a: str, b: str) -> dict:
    rows = nd.caption_pairs([nd.CaptionPair(0, 1, 0.97)], [a, b])
    return {"most_similar": rows, "typical": rows, "same_text": 0, "quantile": 0.9}


def test_analyze_geometry_lists_near_duplicates_and_the_margin_in_logits(tmp_path: Path):
    from sharpclip.analysis.run import analyze_geometry, analyze_near_duplicates
    from sharpclip.config import EvalConfig

    caps = ["a red square left", "a red square right", "a blue circle left", "a green circle right"]
    caps.append(caps[0])  # the same text twice: not a pair, counted
    write_captions(tmp_path / "generic", caps)
    cfg = EvalConfig(suites=["generic"], data_root=str(tmp_path), progress=False)
    analyze_geometry(_Bag(), cfg, tmp_path / "geo", batch_size=2, gamma=0.25, scale=50.0)
    analyze_near_duplicates(_Bag(), cfg, tmp_path / "geo", pairs=2)
    section = json.loads((tmp_path / "geo" / "near_duplicates.json").read_text())["generic"]
    # bag of words: "a red square left" / "... right" share 3 of 4 words (cosine 0.75), the top pair of two texts
    top = section["most_similar"][0]
    assert {top["a"], top["b"]} == {"a red square left", "a red square right"} and section["same_text"] == 1
    assert top["cosine"] == pytest.approx(0.75) and len(section["most_similar"]) == 2
    md = (tmp_path / "geo" / "near_duplicates.md").read_text()
    assert "| a red square **left** | a red square **right** |" in md or "**right** | a red square **left** |" in md
    check_page(tmp_path / "geo" / "near_duplicates.html")
    stats = json.loads((tmp_path / "geo" / "caption_geometry_stats.json").read_text())["generic"]
    assert set(stats["margin"]["per_gamma"]) >= {"0.25"} and stats["margin"]["scale"] == 50.0
    table = (tmp_path / "geo" / "caption_geometry.md").read_text()
    assert "| HN-CLIP Fig. 1: DOCCI | 0.5 | 100 | 4.5 | 42.0 |" in table and "| generic | 0.25 | 50 |" in table


class _Bag:
    """Captions -> normalised word counts (no images): cosines computable by hand."""

    vocab = ("a", "red", "blue", "green", "square", "circle", "left", "right")

    def images(self, refs):
        raise AssertionError("caption geometry must not embed images")

    def texts(self, captions):
        v = torch.tensor([[float(c.split().count(w)) for w in self.vocab] for c in captions])
        return torch.nn.functional.normalize(v, dim=1)
