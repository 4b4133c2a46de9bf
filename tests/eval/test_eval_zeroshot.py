"""Zero-shot classification (eval/zeroshot.py): template averaging and re-normalisation, top-K with ties, CSV input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from sharpclip.eval.zeroshot import evaluate_zeroshot, read_csv, topk_accuracy, zeroshot_classifier


class TableEmbedder:
    """Captions looked up in a fixed table; images by file name in another."""

    def __init__(self, texts: dict[str, list[float]], images: dict[str, list[float]] | None = None) -> None:
        self.t, self.i = texts, images or {}

    def texts(self, captions):
        return torch.nn.functional.normalize(torch.tensor([self.t[c] for c in captions]), dim=1)

    def images(self, refs):
        return torch.nn.functional.normalize(torch.tensor([self.i[Path(r).name] for r in refs]), dim=1)


def test_classifier_averages_normalised_templates_then_renormalises() -> None:
    emb = TableEmbedder({"a cat": [1.0, 0.0], "the cat": [0.0, 2.0], "a dog": [0.0, 1.0], "the dog": [0.0, 1.0]})
    w = zeroshot_classifier(emb, ["cat", "dog"], ["a {}", "the {}"])
    # cat: mean of (1, 0) and (0, 1) (the second normalised from (0, 2)) = (0.5, 0.5) -> (0.7071, 0.7071).
    assert w.shape == (2, 2)
    assert w[:, 0].tolist() == pytest.approx([2**-0.5, 2**-0.5]) and w[:, 1].tolist() == pytest.approx([0.0, 1.0])
    with pytest.raises(ValueError, match="contain"):
        zeroshot_classifier(emb, ["cat"], ["no placeholder"])


def test_topk_with_ties_uses_lower_class_index() -> None:
    w = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # classes 0 and 1 identical
    img = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    acc = topk_accuracy(img, w, torch.tensor([0, 1, 2]), ks=(1, 2))
    # Image 1's class (1) ties with class 0 at a lower index: rank 1, a top-1 miss, a top-2 hit.
    assert acc == {"top1": pytest.approx(200 / 3), "top2": 100.0}


def test_csv_dataset(tmp_path: Path) -> None:
    for name in ("x.png", "y.png"):
        Image.new("RGB", (4, 4)).save(tmp_path / name)
    (tmp_path / "labels.csv").write_text("filepath,label\nx.png,cat\ny.png,dog\n")
    ds = read_csv(tmp_path / "labels.csv")
    assert ds.classnames == ["cat", "dog"] and ds.labels == [0, 1]
    emb = TableEmbedder({"a cat": [1.0, 0.0], "a dog": [0.0, 1.0]}, {"x.png": [0.2, 1.0], "y.png": [0.0, 1.0]})
    out = evaluate_zeroshot(emb, ds, ["a {}"], ks=(1,))
    assert out == {"top1": 50.0, "images": 2, "classes": 2}
    (tmp_path / "bad.csv").write_text("path,class\nx.png,cat\n")
    with pytest.raises(ValueError, match="filepath"):
        read_csv(tmp_path / "bad.csv")
