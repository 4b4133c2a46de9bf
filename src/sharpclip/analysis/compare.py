"""Qualitative retrieval, two models side by side (HN-CLIP Fig. 3, Fig. A10): the caption queries whose ground
truth one model ranks far better than the other, in both directions.

    cases = compare_rankings(Side("InfoNCE", img_a, txt_a), Side("HN-CLIP", img_b, txt_b), caption_to_image)
    write_compare(cases, dataset, "compare/")        # compare.html (+ thumbnails), compare.png, compare.json

For every caption q (text → image), each model's 0-based rank of q's ground-truth image is eval's (eval.metrics.
query_ranks: the best positive, ties to the lower index), so rank 1 on the page is an R@1 hit. The queries with the
largest rank difference r_A − r_B > 0 ("B ranks the ground truth higher") and < 0 ("A does") are kept, `n` of each,
largest first. For each: the caption, each model's top-k images (ground truth framed), the ground truth's rank under
each, and each model's hardest caption negative, the caption of another image with the highest cosine to q under that
model's text tower, with its cosine under both towers (what HN-CLIP's margin γ·Ḡ reads).

The three files (and `compare_files/`) are written by `sharpclip.owned_files`' rule, checked before any index is
built: a file there that sharpclip did not write is refused in one line naming it and `--out`.
"""

from __future__ import annotations

import json
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

    Returns {"models", "k", "queries", "ranks" {model: (N_txt,) 1-based}, "b_better": [case], "a_better": [case]};
    a case is {"query", "ground_truth", "models": [{"model", "gt_rank" (1-based), "top", "scores",
    "hardest_negative": {"caption", "cosine": {model: cos}}}]}."""
    owner = torch.as_tensor(list(caption_to_image))
    positives = pairs_from_caption_index(owner)
    ranks = [query_ranks(s.text, s.image, positives) for s in (a, b)]
    diff = ranks[0] - ranks[1]  # > 0: b ranks the ground truth higher
    cases = {key: [_case(q, (a, b), owner, ranks, k) for q in _picked(diff, n, sign)]
             for key, sign in (("b_better", 1), ("a_better", -1))}  # fmt: skip
    return {"models": [a.name, b.name], "k": k, "queries": len(owner),
            "ranks": {s.name: (r + 1).tolist() for s, r in zip((a, b), ranks, strict=True)}, **cases}  # fmt: skip


# -- the page ---------------------------------------------------------------------------------------------------------
def _direction_title(result: dict[str, Any], key: str) -> str:
    a, b = result["models"]
    better, worse = (b, a) if key == "b_better" else (a, b)
    return f"{better} ranks the ground truth higher than {worse}"


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
    for key in ("b_better", "a_better"):
        page.heading(f"{_direction_title(result, key)} ({len(result[key])} queries)")
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


def write_figure(result: dict[str, Any], dataset: RetrievalSet, out: Path, per_direction: int = 3) -> Path:
    """compare.png: up to `per_direction` queries each way; per query a caption line and one row of top-k per model
    (ground truth framed green, its rank in the row's label)."""
    cases = [c for key in ("b_better", "a_better") for c in result[key][:per_direction]]
    k = result["k"]
    fig = plt.figure(figsize=(1.3 * (k + 1) + 1.5, max(1, len(cases)) * 3.0), layout="constrained")
    subs = fig.subfigures(max(1, len(cases)), 1, squeeze=False)[:, 0]
    for sub, case in zip(subs, cases, strict=False):
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
    if not cases:
        fig.text(0.5, 0.5, "no query ranks differently", ha="center")
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
) -> list[Path]:  # fmt: skip
    """`sharpclip compare`: both models' indexes of the suite (built or resumed, then checked), compared."""
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
    return write_compare(result, dataset, out_dir)
