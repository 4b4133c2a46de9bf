"""`sharpclip search`: index a dataset (or a folder of images) with one or two models and query it by text or image.

    dataset, spec = read_gallery(cfg, images="photos/")           # or suite="docci" / the config's data section
    found = search(cfg, ["runs/hn", "runs/infonce"], dataset, spec, "search-index", text="a red cube left of ...")
    print(format_hits(found)); write_search_page(found, dataset, "search.html")

Each model gets its own index folder, `<index>/<dataset>-<digest>/<model>-<digest>/` (analysis.index): the index's
identity decides it. The dataset part is a readable label plus the first 10 hex digits of the sha256 of how the
dataset is read (the resolved folder, the format, the split, the format's options; or the resolved `--images`
folder); the model part, the model's name plus the digest of its resolved path (or of the name, for a preset or hub
id). Two folders both named `images/`, or two splits of one dataset, get two folders; a mismatch found in one is
never resolved by deleting another's. An index is built on first use (chunks, progress bar, resumable), then
checked against the model's weights and the files before every query. The model is
loaded as `sharpclip eval --model` loads it (a run directory's newest checkpoint, a checkpoint, an export or hub
folder, a tiny preset) and embeds through eval's embedder, with the model's own preprocessing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image
from torch import Tensor

from sharpclip import __version__, owned_files
from sharpclip.analysis.index import (
    Index,
    build_index,
    check_folder,
    load_index,
    model_record,
    remove_index,
    top_k,
)
from sharpclip.analysis.pages import Markup, Page, tag
from sharpclip.data.formats.generic import IMAGE_SUFFIXES
from sharpclip.data.images import describe
from sharpclip.eval.benchmarks import load_eval_set, suite_root
from sharpclip.eval.embed import Embedder, ImageRef
from sharpclip.eval.evaluator import as_embedder
from sharpclip.eval.manifest import cached_weights_sha256
from sharpclip.eval.retrieval import RetrievalSet
from sharpclip.models.factory import create_model
from sharpclip.models.preprocessing import model_transforms
from sharpclip.train.checkpoint import model_source


# -- what is searched -------------------------------------------------------------------------------------------------
def image_folder(root: str | Path) -> RetrievalSet:
    """Every image under `root` (recursive, sorted by relative path); an image's caption is the text of a `.txt` file
    of the same name beside it, when there is one (clip-retrieval's `files` layout)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"--images {root}: no such folder")
    images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not images:
        raise ValueError(f"--images {root}: no image files ({', '.join(IMAGE_SUFFIXES)}) in it or below it")
    captions, owner, files = [], [], []
    for i, path in enumerate(images):
        txt = path.with_suffix(".txt")
        if txt.is_file() and (text := txt.read_text(encoding="utf-8").strip()):
            captions.append(text)
            owner.append(i)
            files.append(txt)
    return RetrievalSet(root.name or "images", [str(p) for p in images], captions, owner, files)


def read_gallery(cfg: Any, images: str | None = None, suite: str | None = None) -> tuple[RetrievalSet, dict]:
    """(dataset, spec): a folder of images, a retrieval suite of `sharpclip eval` (under eval.data_root), or the
    config's own data section (data.format, data.root on data.eval_split: suite `retrieval`)."""
    if images:
        return image_folder(images), {"images": str(Path(images).resolve()), "label": Path(images).resolve().name}
    name = suite or "retrieval"
    dataset = load_eval_set(name, cfg.eval, cfg.data)
    if not isinstance(dataset, RetrievalSet):
        raise ValueError(
            f"suite {name!r} is a {type(dataset).__name__}, not an image-caption retrieval set; search reads "
            "retrieval suites, a data section (data.format, data.root) or --images"
        )
    spec = suite_spec(cfg, name)
    dataset.name = spec["label"]  # what pages call it
    return dataset, spec


# the DataConfig fields that change what a suite reads (with the folder, format and split: an index's data identity)
FORMAT_OPTIONS = ("caption_choice", "docci_test", "dci_caption", "list_file", "list_split", "list_files",
                  "coco_flickr_protocol", "annotation_file", "sharegpt4v_test_size", "image_field", "caption_field",
                  "short_caption_field", "id_field")  # fmt: skip


def suite_spec(cfg: Any, name: str) -> dict[str, Any]:
    """How suite `name` is read: its resolved folder, format, split and format options (what decides its index)."""
    data = asdict(cfg.data)
    options = {k: data[k] for k in FORMAT_OPTIONS} | dict(cfg.eval.data_options.get(name, {}))
    if name == "retrieval":  # the config's data section, on data.eval_split
        root, fmt, split = cfg.data.root, cfg.data.format, options.pop("eval_split", cfg.data.eval_split)
        label = f"{fmt}-{Path(root).resolve().name}"
    else:
        root, fmt, split = str(suite_root(name, cfg.eval)), name, options.pop("eval_split", cfg.eval.split)
        label = name
    return {"suite": name, "format": fmt, "root": str(Path(root).resolve()), "split": split,
            "options": json.loads(json.dumps(options, default=str)), "label": label}  # fmt: skip


# -- models and their indexes -----------------------------------------------------------------------------------------
def slug(text: str) -> str:
    """A folder name from a model or dataset name (`runs/hn` → `runs-hn`)."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", str(text)).strip("-.")[-60:].strip("-.") or "model"


def digest(value: Any) -> str:
    """The first 10 hex digits of the sha256 of `value` as canonical JSON."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:10]


def index_folder(index_root: str | Path, name: str, dataset: RetrievalSet, spec: dict[str, Any]) -> Path:
    """`<index_root>/<dataset label>-<digest of spec>/<model name>-<digest of its resolved path>`: the index's
    identity (how the data is read, which model) decides its folder."""
    model_id = str(Path(name).resolve()) if Path(name).exists() else name
    identity = {k: v for k, v in spec.items() if k != "label"}
    return Path(index_root) / f"{slug(dataset.name)}-{digest(identity)}" / f"{slug(name)}-{digest(model_id)}"


@dataclass
class Searcher:
    """One model ready to search: its name as given, its embedder and its (complete, checked) index."""

    name: str
    embedder: Embedder
    index: Index


def load_model(name: str, cfg: Any) -> tuple[Any, Embedder, dict[str, Any]]:
    """(model, embedder, manifest record) for `name` in any form `sharpclip eval --model` takes."""
    resolved, _ = model_source(name)
    model_cfg = replace(cfg.model, name=resolved)
    model = create_model(model_cfg).eval()
    preprocess, tokenizer = model_transforms(model, alpha=cfg.eval.image_alpha)
    settings = json.dumps([asdict(model_cfg), __version__, torch.__version__, transformers.__version__], default=str)
    digest = cached_weights_sha256(model, weight_files(resolved), settings, digest_cache_dir())
    return model, as_embedder(model, cfg.eval), model_record(name, model, preprocess, tokenizer, digest)


def weight_files(resolved: str) -> list[Path]:
    """The files a model was loaded from: the file itself, or every regular file directly in its folder (config,
    weights, tokenizer); none for a tiny preset or a hub id (its digest is then computed each time)."""
    path = Path(resolved).expanduser()
    if path.is_file() and not path.is_symlink():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if stat.S_ISREG(p.lstat().st_mode))


def digest_cache_dir() -> Path:
    """Where weights digests are remembered: $SHARPCLIP_CACHE, else ~/.cache/sharpclip (as the demo's init)."""
    return Path(os.environ.get("SHARPCLIP_CACHE", "~/.cache/sharpclip")).expanduser()


def open_searcher(
    name: str, cfg: Any, dataset: RetrievalSet, spec: dict, index_root: str | Path, rebuild: bool = False
) -> Searcher:
    """Load model `name`, build or resume its index of `dataset` under `index_root`, check it, and read it."""
    folder = index_folder(index_root, name, dataset, spec)
    owned_files.folder(index_root, "--index")  # a file there: one line naming it
    if folder.parent.is_symlink():  # a folder sharpclip names: never written through a link
        owned_files.folder(folder.parent, "--index", derived=True)
    check_folder(folder)  # before the model is loaded: a folder that is not ours is refused at once
    _, embedder, record = load_model(name, cfg)
    if rebuild:
        remove_index(folder)
    build_index(folder, embedder, record, dataset, spec, progress=cfg.eval.progress)
    return Searcher(name, embedder, load_index(folder))


# -- queries ----------------------------------------------------------------------------------------------------------
@dataclass
class Hits:
    """One model's answer: top-k images (and, for an image query, top-k captions), best first."""

    model: str
    image_scores: list[float]
    images: list[int]
    caption_scores: list[float]
    captions: list[int]


def _query_vector(s: Searcher, text: str | None, image: str | None) -> Tensor:
    if (text is None) == (image is None):
        raise ValueError('give one query: --text "..." or --image FILE')
    if image is not None:
        check_query_image(image)
    return s.embedder.texts([text]) if text is not None else s.embedder.images([ImageRef(str(image))])


def check_query_image(image: str | Path) -> None:
    """Refuse (one line) a `--image` that is not a readable regular file holding an image, saying what it is."""
    path = Path(image)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"--image {image}: no such file") from None
    except OSError as err:
        raise OSError(f"--image {image}: cannot read it ({err.strerror})") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"--image {image}: is a folder, not an image file")
    if not stat.S_ISREG(mode):
        kind = "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise ValueError(f"--image {image}: is {kind}, not an image file")
    try:
        with Image.open(path) as picture:  # the header only: what PIL makes of it
            picture.verify()
    except (OSError, SyntaxError, ValueError) as err:  # UnidentifiedImageError is an OSError
        why = err.strerror if isinstance(err, OSError) and err.strerror else " ".join(str(err).split())
        raise ValueError(f"--image {image}: not an image file PIL can read ({why[:160]})") from None


def query(s: Searcher, text: str | None = None, image: str | None = None, k: int = 10) -> Hits:
    """Top-k images for a text or image query; an image query also gets the top-k captions."""
    if hasattr(s.embedder, "progress"):
        s.embedder.progress = False  # one query: no progress bar
    q = _query_vector(s, text, image)
    iv, ii = top_k(q, s.index.image, k)
    cv, ci = top_k(q, s.index.text, k) if image is not None and s.index.text.numel() else (iv[:, :0], ii[:, :0])
    return Hits(s.name, iv[0].tolist(), ii[0].tolist(), cv[0].tolist(), ci[0].tolist())


def _shorten(text: str, n: int = 90) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def image_captions(dataset: RetrievalSet) -> dict[int, str]:
    """The first caption of each image that has one."""
    out: dict[int, str] = {}
    for caption, i in zip(dataset.captions, dataset.caption_to_image, strict=True):
        out.setdefault(i, caption)
    return out


def source_name(source: Any) -> str:
    """A short name for an image source (an ImageRef's path, else data.images.describe)."""
    return source.describe() if isinstance(source, ImageRef) else describe(source)


def format_hits(found: list[Hits], dataset: RetrievalSet) -> str:
    """The terminal view: per model, rank, cosine, image and its caption (and the caption hits of an image query)."""
    first = image_captions(dataset)
    lines = []
    for h in found:
        lines.append(f"{h.model}: top {len(h.images)} of {len(dataset.images)} images")
        for r, (score, i) in enumerate(zip(h.image_scores, h.images, strict=True)):
            said = f'  "{_shorten(first[i])}"' if i in first else ""
            lines.append(f"  {r + 1:3d}  {score:+.4f}  {source_name(dataset.images[i])}{said}")
        if h.captions:
            lines.append(f"  captions, top {len(h.captions)}:")
            for r, (score, c) in enumerate(zip(h.caption_scores, h.captions, strict=True)):
                lines.append(f'  {r + 1:3d}  {score:+.4f}  "{_shorten(dataset.captions[c])}"')
    return "\n".join(lines)


def search(
    cfg: Any,
    models: list[str],
    dataset: RetrievalSet,
    spec: dict,
    index_root: str | Path,
    text: str | None = None,
    image: str | None = None,
    k: int = 10,
    rebuild: bool = False,
) -> list[Hits]:
    """Answer one query with every model (each through its own index, built or resumed first)."""
    return [query(open_searcher(m, cfg, dataset, spec, index_root, rebuild), text, image, k) for m in models]


# -- the page ---------------------------------------------------------------------------------------------------------
def _ground_truth(dataset: RetrievalSet, text: str | None) -> set[int]:
    """The images a dataset caption equal to the query belongs to (marked on the page)."""
    return {
        i for c, i in zip(dataset.captions, dataset.caption_to_image, strict=True) if text is not None and c == text
    }


def _hit_column(page: Page, h: Hits, dataset: RetrievalSet, truth: set[int]) -> Markup:
    first = image_captions(dataset)
    cells = []
    for r, (score, i) in enumerate(zip(h.image_scores, h.images, strict=True)):
        src = page.thumbnail(dataset.images[i], key=source_name(dataset.images[i]))
        said = f" · {_shorten(first[i], 140)}" if i in first else ""
        label = f"#{r + 1} · cos {score:.4f} · {Path(source_name(dataset.images[i])).name}{said}"
        cells.append(page.figure(src, label, mark=i in truth))
    parts = [tag("h3", h.model), page.row(cells)]
    if h.captions:
        pairs = enumerate(zip(h.caption_scores, h.captions, strict=True))
        rows = [[f"#{r + 1}", f"{score:.3f}", dataset.captions[c]] for r, (score, c) in pairs]
        parts.append(page.table(["rank", "cos", "caption"], rows))
    return Markup("".join(parts))


def write_search_page(
    found: list[Hits], dataset: RetrievalSet, out: str | Path, text: str | None = None, image: str | None = None
) -> Path:
    """An HTML page of the hits, one column per model, thumbnails beside it; a dataset image whose caption is the
    query exactly is framed as the ground truth."""
    page = Page(
        out,
        thumb_size=150,
        title=f"Search {dataset.name}: " + (_shorten(text, 60) if text is not None else Path(image).name),
        flag="--html",
    )
    if text is not None:
        page.add(tag("p", text, class_="query"))
    else:
        page.add(page.row([page.figure(page.thumbnail(ImageRef(str(image)), key="query"), f"query: {image}")]))
    truth = _ground_truth(dataset, text)
    note = f"{len(dataset.images)} images, {len(dataset.captions)} captions; cosine similarity, exact search."
    page.paragraph(note + (" Framed in green: the image this caption belongs to." if truth else ""), note=True)
    page.add(page.columns(_hit_column(page, h, dataset, truth) for h in found))
    return page.write()
