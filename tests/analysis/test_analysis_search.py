"""The search index (analysis/index.py) and `sharpclip search` (analysis/search.py): exact top-k against a full sort,
top-1 against eval's R@1 ranking on the same model and data, resumable builds, refusals, the page and the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from _support.html_pages import check_page
from _support.tiny_files import write_generic
from sharpclip.analysis import index as ix
from sharpclip.analysis import search as s
from sharpclip.cli import main
from sharpclip.config import load_config
from sharpclip.eval.metrics import pairs_from_caption_index, query_ranks
from sharpclip.eval.suite import run_eval
from sharpclip.owned_files import NotOurs


def _unit(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


def test_top_k_equals_a_stable_full_sort_with_ties_and_chunks():
    gallery = _unit(50, 8, 0)
    gallery[[7, 23, 41]] = gallery[30].clone()  # exact ties: the lower index must come first, as eval counts them
    q = torch.cat([gallery[30:31], _unit(4, 8, 1)])
    scores = q @ gallery.T
    want = scores.argsort(dim=1, descending=True, stable=True)[:, :6]
    for chunk in (7, 16, 50, 1000):
        v, i = ix.top_k(q, gallery, 6, chunk_size=chunk)
        assert torch.equal(i, want), chunk
        assert torch.allclose(v, scores.gather(1, want))
    assert ix.top_k(q, gallery[:3], 10)[1].shape == (5, 3)  # k larger than the gallery


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_generic(tmp_path / "data", n=12, splits=("test",))


def _cfg(data: Path, *extra: str):
    return load_config(None, ["model.name=tiny-clip", "data.format=generic", f"data.root={data}",
                              "eval.progress=false", *extra])  # fmt: skip


@pytest.mark.parametrize("suite", ["retrieval", "synthdense"])
def test_index_top1_is_evals_r1_ranking(data: Path, tmp_path: Path, suite: str):
    # "retrieval": the config's data section; "synthdense": the suite reading SynthDense's layout under --data-root
    if suite == "synthdense":
        data.rename(tmp_path / "synthdense")
        data = tmp_path / "synthdense"
    cfg = _cfg(data, f"eval.output_dir={tmp_path / 'eval'}", f"eval.suites=[{suite}]", f"eval.data_root={tmp_path}")
    dataset, spec = s.read_gallery(cfg, suite=suite)
    searcher = s.open_searcher("tiny-clip", cfg, dataset, spec, tmp_path / "index")
    idx = searcher.index
    _, top1 = ix.top_k(idx.text, idx.image, 1)
    truth = torch.tensor(dataset.caption_to_image)
    ranks = query_ranks(idx.text, idx.image, pairs_from_caption_index(truth))
    assert torch.equal(top1[:, 0] == truth, ranks == 0)
    report = json.loads(run_eval(cfg)[0].read_text())[suite]
    assert report["t2i"]["R@1"] == pytest.approx(100 * (top1[:, 0] == truth).float().mean().item())
    # the same caption embedded fresh as a query finds the same first image as the stored text embedding
    for c in (0, 5, 11):
        assert s.query(searcher, text=dataset.captions[c], k=1).images == [int(top1[c, 0])]


class Counting:
    """An Embedder over fixed vectors by item, counting items embedded and failing after `fail_after` calls."""

    def __init__(self, vectors: dict, fail_after: int | None = None):
        self.vectors, self.fail_after, self.calls, self.items = vectors, fail_after, 0, 0

    def _embed(self, items):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt  # the build is killed here
        self.calls += 1
        self.items += len(items)
        return torch.stack([self.vectors[x] for x in items])

    images = texts = _embed


def _record(digest: str = "d0") -> dict:
    return {"name": "m", "class": "X", "digest": digest, "preprocessing": {"size": 4}}


def test_a_killed_build_resumes_where_it_stopped(data: Path, tmp_path: Path):
    dataset, spec = s.read_gallery(_cfg(data))
    keys = [*dataset.images, *dataset.captions]
    vectors = {k: v for k, v in zip(keys, _unit(len(keys), 6, 3), strict=True)}
    killed = Counting(vectors, fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        ix.build_index(tmp_path / "i", killed, _record(), dataset, spec, chunk_size=5, progress=False)
    assert sorted(p.name for p in (tmp_path / "i").glob("*.safetensors")) == [
        "image-00000.safetensors",
        "image-00001.safetensors",
    ]
    resumed = Counting(vectors)
    ix.build_index(tmp_path / "i", resumed, _record(), dataset, spec, progress=False)
    assert resumed.items == 2 + 12  # the last image chunk (2 of 12) and every caption: nothing embedded twice
    idx = ix.load_index(tmp_path / "i")
    assert torch.equal(idx.image, torch.stack([vectors[k] for k in dataset.images]))
    assert torch.equal(idx.text, torch.stack([vectors[k] for k in dataset.captions]))
    again = Counting(vectors)
    ix.build_index(tmp_path / "i", again, _record(), dataset, spec, progress=False)
    assert again.items == 0


def test_changed_model_or_files_are_refused_in_one_line(data: Path, tmp_path: Path, monkeypatch):
    dataset, spec = s.read_gallery(_cfg(data))
    keys = [*dataset.images, *dataset.captions]
    vectors = {k: v for k, v in zip(keys, _unit(len(keys), 6, 3), strict=True)}
    ix.build_index(tmp_path / "i", Counting(vectors), _record(), dataset, spec, progress=False)
    with pytest.raises(ix.IndexMismatch, match="weights differ") as err:
        ix.build_index(tmp_path / "i", Counting(vectors), _record("d1"), dataset, spec, progress=False)
    assert "\n" not in str(err.value)
    image = Path(dataset.images[4])
    hashed = []
    real_sha = ix.sha256_file
    monkeypatch.setattr(ix, "sha256_file", lambda p: hashed.append(Path(p).name) or real_sha(p))
    ix.build_index(tmp_path / "i", Counting(vectors), _record(), dataset, spec, progress=False)
    assert hashed == []  # an unchanged index is checked by stat alone: no file is read again
    os.utime(image, ns=(1, 1))  # touched, same bytes: still the same file
    ix.build_index(tmp_path / "i", Counting(vectors), _record(), dataset, spec, progress=False)
    assert hashed == [image.name]  # only the touched file is hashed
    Image.new("RGB", (32, 32), (1, 2, 3)).save(image)
    with pytest.raises(ix.IndexMismatch, match=f"{image.name} changed"):
        ix.build_index(tmp_path / "i", Counting(vectors), _record(), dataset, spec, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("user data")
    with pytest.raises(NotOurs, match="not empty and not an index sharpclip wrote"):
        ix.build_index(tmp_path / "other", Counting(vectors), _record(), dataset, spec, progress=False)
    with pytest.raises(NotOurs, match="not an index, nothing deleted"):
        s.remove_index(tmp_path / "other")
    assert (tmp_path / "other" / "mine.txt").read_text() == "user data"


def test_model_digest_follows_the_weights():
    a = torch.nn.Linear(3, 2)
    d = ix.weights_sha256(a)
    assert d == ix.weights_sha256(a)
    with torch.no_grad():
        a.weight[0, 0] += 1e-6
    assert ix.weights_sha256(a) != d


def test_image_folder_reads_images_and_side_captions(tmp_path: Path):
    (tmp_path / "pics" / "sub").mkdir(parents=True)
    for name in ("b.png", "sub/a.jpg", "c.webp"):
        Image.new("RGB", (8, 8)).save(tmp_path / "pics" / name)
    (tmp_path / "pics" / "sub" / "a.txt").write_text("a cat <b>on</b> a mat\n")
    (tmp_path / "pics" / "notes.md").write_text("not an image")
    got = s.image_folder(tmp_path / "pics")
    assert [Path(p).relative_to(tmp_path / "pics").as_posix() for p in got.images] == ["b.png", "c.webp", "sub/a.jpg"]
    assert got.captions == ["a cat <b>on</b> a mat"] and got.caption_to_image == [2]
    with pytest.raises(ValueError, match="no image files"):
        s.image_folder(_empty(tmp_path))


def _empty(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def test_cli_search_two_models_terminal_and_page(data: Path, tmp_path: Path, capsys):
    base = ["data.format=generic", f"data.root={data}", "eval.progress=false", "--index", str(tmp_path / "ix")]
    caption = json.loads((data / "test.jsonl").read_text().splitlines()[3])["caption"]
    page = tmp_path / "pages" / "q.html"
    args = ["search", "--model", "tiny-clip", "--model", "tiny-siglip", *base, "--text", caption, "-k", "4"]
    assert main([*args, "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "tiny-clip: top 4 of 12 images" in out and "tiny-siglip: top 4 of 12 images" in out
    parsed = check_page(page)
    assert parsed.tags.count("h3") == 2 and len(parsed.images) == 8
    assert caption in parsed.text and parsed.classes.count("mark") <= 2  # the ground truth, when it is in a top 4
    assert main(["search", "--model", "tiny-clip", *base, "--image", str(data / "images" / "test-3.png"), "-k", "2",
                 "--html", str(tmp_path / "img.html")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "+1.0000  " + str(data / "images" / "test-3.png") in out  # the image finds itself first
    assert "captions, top 2:" in out
    check_page(tmp_path / "img.html")
    Image.new("RGB", (32, 32)).save(data / "images" / "test-0.png")
    assert main(["search", "--model", "tiny-clip", *base, "--text", "x"]) == 2
    assert "test-0.png changed" in capsys.readouterr().err
    assert main(["search", "--model", "tiny-clip", *base, "--text", "x", "--rebuild"]) == 0
