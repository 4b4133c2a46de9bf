"""Qualitative retrieval, two models side by side (HN-CLIP Fig. 3, Fig. A10): the caption queries whose ground
truth one model ranks far better than the other, in both directions.

    cases = compare_rankings(Side("InfoNCE", img_a, txt_a), Side("HN-CLIP", img_b, txt_b), caption_to_image)
    write_compare(cases, dataset, "compare/")        # compare.html (+ thumbnails), compare.png, compare.json

For every caption q (text → image), each model's 0-based rank of q's ground-truth image is eval's (eval.metrics.
query_ranks: the best positive, ties to the lower index), so rank 1 on the page is an R@1 hit. The queries with the
largest rank difference r_A − r_B > 0 ("B ranks the ground truth higher") and < 0 ("A does") are kept, `n` of each,
largest first. The totals count every query: how many each model ranks higher, how many tie, a two-sided sign test
over the untied ones, and each model's R@1 and mean rank; a move is "small" when it is at most `SMALL_MOVE` ranks or
a tenth of the worse rank (10 → 9, 31 → 30), and the page says when every move it shows is small. For each: the
caption, each model's top-k images (ground truth framed), the ground truth's rank under
each, and each model's hardest caption negative, the caption of another image with the highest cosine to q under that
model's text tower, with its cosine under both towers (what HN-CLIP's margin γ·Ḡ reads).

The three files (and `compare_files/`) are written by `sharpclip.owned_files`' rule, checked before any index is
built: a file there that sharpclip did not write is refused in one line naming it and `--out`.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from torch import Tensor

from sharpclip import owned_files
from sharpclip.analysis.index import top_k
from sharpclip.analysis.pages import Markup, Page, escape, load_any, marked_differences, tag
from sharpclip.analysis.search import open_searcher, read_gallery
from sharpclip.eval.metrics import pairs_from_caption_index, query_ranks
from sharpclip.eval.retrieval import RetrievalSet


@dataclass
class Side:
    """One model's embeddings of the dataset: image (N_img, D), text (N_txt, D), L2-normalised."""

    name: str
    image: Tensor
    text: Tensor


def hardest_negative(text: Tensor, owner: Tensor, q: int) -> tuple[int, float]:
    """(caption index, cosine) of the caption of another image closest to caption q. text: (N_txt, D); owner:
    (N_txt,) each caption's image. (-1, nan) when every caption belongs to q's image."""
    sims = text @ text[q]
    sims[owner == owner[q]] = float("-inf")
    j = int(sims.argmax())
    return (j, float(sims[j])) if torch.isfinite(sims[j]) else (-1, float("nan"))


SMALL_MOVE = 2  # a rank move of at most this many places (or a tenth of the worse rank) is "small"


def is_small_move(rank_a: int, rank_b: int) -> bool:
    """Whether moving between these 1-based ranks is small: at most SMALL_MOVE places or a tenth of the worse rank."""
    return abs(rank_a - rank_b) <= max(SMALL_MOVE, 0.1 * max(rank_a, rank_b))


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test p-value of `wins` against `losses` (ties left out): 1.0 when there are none."""
    n, low = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(low + 1)) / 2**n)


def totals(a: str, b: str, ranks_a: Tensor, ranks_b: Tensor) -> dict[str, Any]:
    """Over every query (1-based ranks): how many each model ranks higher, how many tie, how many of each way are
    large moves (not `is_small_move`), the sign test's p, and each model's R@1 (%) and mean rank."""
    diff = ranks_a - ranks_b
    moves = [not is_small_move(int(x), int(y)) for x, y in zip(ranks_a.tolist(), ranks_b.tolist(), strict=True)]
    large = torch.tensor(moves, dtype=torch.bool)
    b_better, a_better = int((diff > 0).sum()), int((diff < 0).sum())
    return {"queries": len(diff), "b_better": b_better, "a_better": a_better, "tied": int((diff == 0).sum()),
            "large_moves": {"b_better": int((large & (diff > 0)).sum()), "a_better": int((large & (diff < 0)).sum())},
            "sign_test_p": sign_test(b_better, a_better),
            "R@1": {n: round(100 * float((r == 1).double().mean()), 4) for n, r in ((a, ranks_a), (b, ranks_b))},
            "mean_rank": {n: round(float(r.double().mean()), 4) for n, r in ((a, ranks_a), (b, ranks_b))}}  # fmt: skip


def totals_text(result: dict[str, Any]) -> str:
    """The totals as two lines for the terminal and the page."""
    a, b = result["models"]
    t = result["totals"]
    r1 = ", ".join(f"{m} {t['R@1'][m]:.1f}" for m in (a, b))
    mean = ", ".join(f"{m} {t['mean_rank'][m]:.1f}" for m in (a, b))
    return (f"over {t['queries']} queries: {b} ranks the ground truth higher on {t['b_better']}, {a} on "
            f"{t['a_better']}, tied on {t['tied']} (two-sided sign test p = {t['sign_test_p']:.3g})\n"
            f"R@1 (%): {r1}; mean ground-truth rank: {mean}")  # fmt: skip


def _picked(diff: Tensor, n: int, sign: int) -> list[int]:
    """Up to n queries with sign·diff > 0, largest first (ties: lower query index first)."""
    order = (-sign * diff).argsort(stable=True)
    return [int(q) for q in order[:n] if sign * diff[q] > 0]


def _case(q: int, sides: Sequence[Side], owner: Tensor, ranks: list[Tensor], k: int) -> dict[str, Any]:
    per_model = []
    hardest = [hardest_negative(s.text, owner, q) for s in sides]
    for s, r, (j, _) in zip(sides, ranks, hardest, strict=True):
        scores, images = top_k(s.text[q : q + 1], s.image, k)
        cos = {o.name: float(o.text[q] @ o.text[j]) if j >= 0 else float("nan") for o in sides}
        per_model.append({"model": s.name, "gt_rank": int(r[q]) + 1, "top": images[0].tolist(),
                          "scores": [round(v, 6) for v in scores[0].tolist()],
                          "hardest_negative": {"caption": j, "cosine": cos}})  # fmt: skip
    return {"query": q, "ground_truth": int(owner[q]), "models": per_model}


def compare_rankings(a: Side, b: Side, caption_to_image: Sequence[int], k: int = 5, n: int = 6) -> dict[str, Any]:
    """The queries whose ground-truth rank differs most between `a` and `b`, n per direction (module docstring).

    Returns {"models", "k", "queries", "totals" (see `totals`), "ranks" {model: (N_txt,) 1-based}, "b_better":
    [case], "a_better": [case]};
    a case is {"query", "ground_truth", "models": [{"model", "gt_rank" (1-based), "top", "scores",
    "hardest_negative": {"caption", "cosine": {model: cos}}}]}."""
    owner = torch.as_tensor(list(caption_to_image))
    positives = pairs_from_caption_index(owner)
    ranks = [query_ranks(s.text, s.image, positives) for s in (a, b)]
    diff = ranks[0] - ranks[1]  # > 0: b ranks the ground truth higher
    cases = {key: [_case(q, (a, b), owner, ranks, k) for q in _picked(diff, n, sign)]
             for key, sign in (("b_better", 1), ("a_better", -1))}  # fmt: skip
    return {"models": [a.name, b.name], "k": k, "queries": len(owner),
            "totals": totals(a.name, b.name, ranks[0] + 1, ranks[1] + 1),
            "ranks": {s.name: (r + 1).tolist() for s, r in zip((a, b), ranks, strict=True)}, **cases}  # fmt: skip


# -- the page ---------------------------------------------------------------------------------------------------------
def _direction_title(result: dict[str, Any], key: str) -> str:
    a, b = result["models"]
    better, worse = (b, a) if key == "b_better" else (a, b)
    return f"{better} ranks the ground truth higher than {worse}"


def _direction_heading(result: dict[str, Any], key: str) -> str:
    """'B ranks the ground truth higher than A: 5 of 40 queries (4 shown, largest moves first)'."""
    shown, t = len(result[key]), result.get("totals")
    total = f"{t[key]} of {t['queries']} queries" if t else f"{shown} queries"
    return f"{_direction_title(result, key)}: {total} ({shown} shown, largest moves first)"


def _small_case(case: dict[str, Any]) -> bool:
    return is_small_move(*(m["gt_rank"] for m in case["models"]))


def _model_block(page: Page, m: dict[str, Any], case: dict[str, Any], dataset: RetrievalSet) -> Markup:
    gt = case["ground_truth"]
    cells = []
    for r, (i, score) in enumerate(zip(m["top"], m["scores"], strict=True)):
        label = f"#{r + 1} · cos {score:.3f}" + (" · ground truth" if i == gt else "")
        cells.append(page.figure(page.thumbnail(dataset.images[i], key=f"img{i}"), label, mark=i == gt))
    if gt not in m["top"]:  # shown apart, so the reader sees what was missed
        cells.append(page.figure(page.thumbnail(dataset.images[gt], key=f"img{gt}"),
                                 f"ground truth: rank {m['gt_rank']}", mark=True))  # fmt: skip
    neg, query = m["hardest_negative"], dataset.captions[case["query"]]
    said = marked_differences(query, dataset.captions[neg["caption"]]) if neg["caption"] >= 0 else "(none)"
    cosines = ", ".join(f"{name} {v:.4f}" for name, v in neg["cosine"].items())
    intro = Markup(f"hardest caption negative under {tag('b', m['model'])}, the words that differ from the query "
                   f"marked (cosine {escape(cosines)}): ")  # fmt: skip
    parts = [tag("h3", f"{m['model']}: ground truth at rank {m['gt_rank']}"), page.row(cells),
             tag("p", intro + tag("i", said), class_="note")]  # fmt: skip
    return Markup("".join(parts))


def write_page(result: dict[str, Any], dataset: RetrievalSet, out: Path, figure: Path | None = None) -> Path:
    """compare.html: per direction, per query, the caption and each model's column."""
    a, b = result["models"]
    page = Page(out, f"Qualitative retrieval: {a} vs {b} on {dataset.name}", thumb_size=96, flag="--out")  # 5 a row
    page.paragraph(f"{result['queries']} caption queries over {len(dataset.images)} images. Shown: the queries whose "
                   f"ground-truth rank differs most between the two models (top {result['k']} per model, the ground "
                   "truth framed in green; rank 1 is an R@1 hit).", note=True)  # fmt: skip
    if result.get("sources"):
        page.paragraph("Models: " + "; ".join(f"{k} = {v}" for k, v in result["sources"].items()), note=True)
    if figure is not None:
        page.add(tag("p", Markup(f'The same cases as a figure: <a href="{page.local(figure)}">{figure.name}</a>')))
    t = result.get("totals")
    if t:
        page.add(tag("p", Markup("<br>".join(escape(line) for line in totals_text(result).splitlines())),
                     class_="query"))  # fmt: skip
        if not any(t["large_moves"].values()):
            page.paragraph(f"Every rank move between the two models is small (at most {SMALL_MOVE} places or a "
                           "tenth of the rank): the cases below differ by little more than a near-tie.",
                           note=True)  # fmt: skip
    for key in ("b_better", "a_better"):
        page.heading(_direction_heading(result, key))
        if result[key] and all(_small_case(c) for c in result[key]):
            page.paragraph("Every move shown this way is small (at most "
                           f"{SMALL_MOVE} places or a tenth of the rank).", note=True)  # fmt: skip
        if not result[key]:
            page.paragraph("No query: no caption's ground truth is ranked higher this way.", note=True)
        for case in result[key]:
            ranks = " → ".join(f"{m['model']} #{m['gt_rank']}" for m in case["models"])
            page.add(tag("p", Markup(f"{tag('b', ranks)}<br>") + tag("span", dataset.captions[case["query"]]),
                         class_="query"))  # fmt: skip
            page.add(page.columns(_model_block(page, m, case, dataset) for m in case["models"]))
    return page.write()


# -- the figure -------------------------------------------------------------------------------------------------------
def _thumb(dataset: RetrievalSet, i: int, size: int = 96) -> Any:
    image = load_any(dataset.images[i]).convert("RGB")
    image.thumbnail((size, size))
    return image


def _figure_rows(result: dict[str, Any], per_direction: int) -> list[tuple[str, Any]]:
    """('heading', text) before each direction's ('case', case) rows; a direction without cases keeps its heading."""
    rows: list[tuple[str, Any]] = []
    for key in ("b_better", "a_better"):
        cases = result[key][:per_direction]
        heading = _direction_heading({**result, key: cases}, key) if cases else _direction_title(result, key)
        rows.append(("heading", heading if cases else f"{heading}: no query"))
        rows += [("case", c) for c in cases]
    return rows


def _case_row(sub: Any, case: dict[str, Any], dataset: RetrievalSet, k: int) -> None:
    sub.suptitle(textwrap.fill(dataset.captions[case["query"]], 110), fontsize=7, ha="left", x=0.01)
    axes = sub.subplots(2, k + 1, squeeze=False)
    for row, m in enumerate(case["models"]):
        shown = m["top"] + ([] if case["ground_truth"] in m["top"] else [case["ground_truth"]])
        for col, ax in enumerate(axes[row]):
            ax.set_xticks([]), ax.set_yticks([])
            if col >= len(shown):
                ax.axis("off")
                continue
            i = shown[col]
            ax.imshow(_thumb(dataset, i))
            gt = i == case["ground_truth"]
            for spine in ax.spines.values():
                spine.set_edgecolor("#1a9850" if gt else "#bbbbbb")
                spine.set_linewidth(3 if gt else 0.5)
            ax.set_title(f"#{col + 1}" if col < len(m["top"]) else f"GT #{m['gt_rank']}", fontsize=7)
        axes[row][0].set_ylabel(f"{m['model']}\nGT rank {m['gt_rank']}", fontsize=7)


def write_figure(result: dict[str, Any], dataset: RetrievalSet, out: Path, per_direction: int = 3) -> Path:
    """compare.png: per direction a heading (who ranks higher, how many of all queries), then up to `per_direction`
    queries; per query a caption line and one row of top-k per model (ground truth framed green, its rank in the
    row's label)."""
    rows, k = _figure_rows(result, per_direction), result["k"]
    heights = [0.45 if kind == "heading" else 3.0 for kind, _ in rows]
    fig = plt.figure(figsize=(1.3 * (k + 1) + 1.5, sum(heights)), layout="constrained")
    for sub, (kind, item) in zip(fig.subfigures(len(rows), 1, height_ratios=heights, squeeze=False)[:, 0], rows,
                                 strict=True):  # fmt: skip
        if kind == "heading":
            sub.set_facecolor("#eef3f8")
            sub.text(0.01, 0.5, item, fontsize=9, fontweight="bold", ha="left", va="center")
        else:
            _case_row(sub, item, dataset, k)
    try:
        with owned_files.writing(out, "--out") as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return out


def write_compare(result: dict[str, Any], dataset: RetrievalSet, out_dir: str | Path) -> list[Path]:
    """compare.json (the cases with captions), compare.png and compare.html (+ compare_files/) into `out_dir`."""
    out_dir = Path(out_dir)
    check_outputs(out_dir)
    figure = write_figure(result, dataset, out_dir / "compare.png")
    numbers = {**result, "captions": {c["query"]: dataset.captions[c["query"]]
                                       for key in ("b_better", "a_better") for c in result[key]}}  # fmt: skip
    js = owned_files.write_text(out_dir / "compare.json", json.dumps(numbers, indent=1) + "\n", "--out")
    return [write_page(result, dataset, out_dir / "compare.html", figure), figure, js]


def check_outputs(out_dir: Path) -> None:
    """Refuse (one line) an --out that is a file, or that holds a compare.html, .png, .json or compare_files that
    sharpclip did not write; writes nothing."""
    owned_files.check([out_dir / f"compare.{ext}" for ext in ("json", "png")], "--out")
    Page(out_dir / "compare.html", "", flag="--out").claim()


def short_names(models: Sequence[str]) -> list[str]:
    """Labels for the page and figure: each model's last path part (`runs/x/hn` → `hn`) when those differ, else the
    names as given."""
    short = [Path(m).name or m for m in models]
    return short if len(set(short)) == len(short) else list(models)


def run_compare(
    cfg: Any, models: Sequence[str], suite: str | None, index_root: str | Path, out_dir: str | Path, k: int = 5,
    n: int = 6, rebuild: bool = False,
) -> tuple[list[Path], dict[str, Any]]:  # fmt: skip
    """`sharpclip compare`: both models' indexes of the suite (built or resumed, then checked), compared; the files
    written and the result (its "totals" for the terminal)."""
    if len(models) != 2:
        raise ValueError(f"compare takes two models (--model A --model B), got {len(models)}")
    check_outputs(Path(out_dir))  # before any index is built
    dataset, spec = read_gallery(cfg, suite=suite)
    if not dataset.captions:
        raise ValueError(f"{dataset.name}: no captions to query with; compare needs an image-caption suite")
    a, b = (open_searcher(m, cfg, dataset, spec, index_root, rebuild) for m in models)
    short = short_names(models)
    result = compare_rankings(Side(short[0], a.index.image, a.index.text), Side(short[1], b.index.image, b.index.text),
                              dataset.caption_to_image, k, n)  # fmt: skip
    result["sources"] = dict(zip(short, models, strict=True))
    return write_compare(result, dataset, out_dir), result
