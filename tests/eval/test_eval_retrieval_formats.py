"""Retrieval through the suite over the data package's fixtures in each release layout (tests/fixtures/data): every
image loads, captions map to their images (5 per image for Karpathy COCO/Flickr), and the report has both directions."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from sharpclip.config import EvalConfig
from sharpclip.eval.benchmarks import load_eval_set
from sharpclip.eval.embed import load_image
from sharpclip.eval.suite import run_suite

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"
EXPECTED = {  # format: (images, captions) in the fixture's test split
    "docci": (3, 3),
    "dci": (2, 2),
    "long_dci": (4, 4),
    "urban1k": (3, 3),
    "sharegpt4v": (4, 4),
    "karpathy": (2, 10),
    "generic": (2, 2),
}
READS = {  # format: the annotation files its reader opens for the test split, relative to the fixture root
    "docci": ["docci_descriptions.jsonlines"],  # not docci_test.json: that is GOAL's list, unread without list_file
    "dci": [
        f"densely_captioned_images/{name}"
        for name in ("splits.json", "complete/102-data.json", "complete/104-data.json")
    ],
    "long_dci": ["dci_long.csv"],
    "urban1k": ["Urban1k/caption/1.txt", "Urban1k/caption/2.txt", "Urban1k/caption/10.txt"],
    "sharegpt4v": ["share-captioner_coco_lcs_sam_1246k_1107.json"],
    "karpathy": ["dataset_coco.json"],
    "generic": ["test.csv"],
}


class PixelHashEmbedder:
    """Images -> a vector seeded by their decoded pixels (so every image must load); captions -> by their text."""

    @staticmethod
    def _vec(key: bytes) -> torch.Tensor:
        seed = int.from_bytes(hashlib.sha256(key).digest()[:4], "little")
        return torch.randn(16, generator=torch.Generator().manual_seed(seed))

    def images(self, refs):
        vecs = [self._vec(np.asarray(load_image(r) if isinstance(r, str | Path) else r).tobytes()) for r in refs]
        return torch.nn.functional.normalize(torch.stack(vecs), dim=1)

    def texts(self, captions):
        return torch.nn.functional.normalize(torch.stack([self._vec(c.encode()) for c in captions]), dim=1)


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_retrieval_over_release_fixture(fmt: str) -> None:
    cfg = EvalConfig(suites=[fmt], roots={fmt: str(FIXTURES / fmt)}, recall_k=[1, 50], progress=False)
    es = load_eval_set(fmt, cfg)
    assert (len(es.images), len(es.captions)) == EXPECTED[fmt]
    assert sorted(set(es.caption_to_image)) == list(range(len(es.images)))
    res = run_suite(PixelHashEmbedder(), cfg)
    r = res.results[fmt]
    assert r["t2i"]["R@50"] == 100.0 and r["i2t"]["R@50"] == 100.0  # galleries < 50: every positive is ranked
    assert 0.0 <= r["t2i"]["R@1"] <= 100.0 and r["t2i"]["mean_rank"] >= 1.0
    assert res.datasets[fmt]["files"] and all(len(f["sha256"]) == 64 for f in res.datasets[fmt]["files"])


@pytest.mark.parametrize("fmt", sorted(READS))
def test_manifest_lists_exactly_the_files_the_reader_opened(fmt: str) -> None:
    cfg = EvalConfig(suites=[fmt], roots={fmt: str(FIXTURES / fmt)}, recall_k=[1], progress=False)
    record = run_suite(PixelHashEmbedder(), cfg).datasets[fmt]
    assert [str(Path(f["path"]).relative_to(FIXTURES / fmt)) for f in record["files"]] == READS[fmt]
    assert "sha256_of_sorted_list" not in record["images"]  # eval.hash_images is off by default
