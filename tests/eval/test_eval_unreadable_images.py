"""An unreadable image in an evaluation (SPEC under its default `on_bad_sample: error`) or given as `search --image`
is one line under 300 characters naming the file (and, in an evaluation, the record that names it) with advice
that applies to the command: never a loader worker's traceback flattened into the message ("Caught
FileNotFoundError in DataLoader worker process 0 ... Original Traceback"), never "check --data-root" for search."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from sharpclip.cli import main
from sharpclip.eval.embed import ModelEmbedder, UnreadableImage

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "data" / "spec"


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line[:2].isdigit()]  # log lines: HH:MM:SS
    assert len(lines) == 1 and "Traceback" not in err and "worker" not in err, err
    assert len(lines[0]) < 300, (len(lines[0]), lines[0])
    return lines[0]


class _Pixels:
    size = 8

    def __call__(self, image):
        return torch.zeros(3, 8, 8)


class _Model:
    def encode_image(self, pixels):
        return torch.ones(len(pixels), 4)


def test_the_embedder_raises_the_images_own_error_not_the_loader_workers(tmp_path):
    """Decoded in a worker process (num_workers=1): the error is the image's own, raised in this process."""
    good, bad = tmp_path / "a.png", tmp_path / "b.jpg"
    Image.new("RGB", (8, 8)).save(good)
    bad.write_text("not an image")
    embedder = ModelEmbedder(model=_Model(), preprocess=_Pixels(), tokenizer=None, device="cpu", progress=False,
                             num_workers=1, batch_size=1)  # fmt: skip
    with pytest.raises(UnreadableImage) as caught:
        embedder.images([str(good), str(bad)])
    assert str(caught.value) == f"cannot read image {bad}: not an image file PIL can decode"
    with pytest.raises(UnreadableImage, match=r"cannot read image .*missing\.png: no such file$"):
        embedder.images([str(tmp_path / "missing.png")])


def _spec(root: Path) -> Path:
    shutil.copytree(FIXTURE, root / "spec")
    return root / "spec"


def _first_query(spec: Path, query: str) -> None:
    """The first image→text item of subset `count` names `query` as its image."""
    path = spec / "count" / "image2text.json"
    rows = json.loads(path.read_text())
    rows[0]["query"] = query
    path.write_text(json.dumps(rows))


def _eval_spec(*settings: str, out: str = "out") -> list[str]:
    return ["eval", "--model", "tiny-clip", "--suite", "spec", "--data-root", "h", "--out", out,
            "eval.progress=false", *settings]  # fmt: skip


@pytest.mark.parametrize("fault", ["one image missing", "every images folder missing", "a query naming a text file"])
def test_an_unreadable_spec_image_is_one_line_naming_the_record_and_the_file(tmp_path, monkeypatch, capsys, fault):
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    spec = _spec(Path("h"))
    if fault == "one image missing":
        (spec / "count" / "images" / "count_3.png").unlink()
    elif fault == "every images folder missing":
        for folder in spec.glob("*/images"):
            shutil.rmtree(folder)
    else:
        Path("passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
        _first_query(spec, "../../../passwd")
    assert main(_eval_spec("eval.num_workers=1")) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("sharpclip eval: h/spec/") and ".json[" in line and "cannot read image h/spec/" in line
    assert "eval.data_options.spec.on_bad_sample=skip" in line and "--data-root" not in line
    if fault == "one image missing":
        assert "count/images/count_3.png: no such file" in line
    elif fault == "a query naming a text file":
        assert "h/spec/count/image2text.json[0]: " in line and "not an image file PIL can decode" in line
    assert not Path("out/eval_report.json").exists()


def test_under_skip_an_unreadable_spec_image_is_skipped_and_counted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec = _spec(Path("h"))
    _first_query(spec, "images/gone.png")
    skip = "eval.data_options.spec.on_bad_sample=skip"
    assert main(_eval_spec(skip)) == 0
    report = json.loads(Path("out/eval_report.json").read_text())["spec"]
    assert report["skipped"] == 1 and report["i2t_items"]["count"] == 3
    (spec / "count" / "images" / "count_3.png").unlink()  # a candidate of every text-to-image item of `count`
    assert main(_eval_spec(skip, out="out2")) == 2
    assert "every t2i sample of subset 'count' was skipped as bad" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("kind", ["text file", "missing", "folder"])
def test_an_unreadable_search_image_is_one_line_naming_the_flag(tmp_path, monkeypatch, capsys, kind):
    monkeypatch.chdir(tmp_path)
    Path("es").mkdir()
    for i in range(3):
        Image.new("RGB", (16, 16), (60 * i, 80, 120)).save(f"es/{i}.jpg")
    query = {"text file": "notimg.jpg", "missing": "nothere.jpg", "folder": "adir.jpg"}[kind]
    if kind == "text file":
        Path(query).write_text("not an image")
    elif kind == "folder":
        Path(query).mkdir()
    argv = ["search", "--model", "tiny-clip", "--images", "es", "--index", "idx", "-k", "2", "--image", query,
            "eval.progress=false"]  # fmt: skip
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"sharpclip search: --image {query}: ") and "--data-root" not in line, line
