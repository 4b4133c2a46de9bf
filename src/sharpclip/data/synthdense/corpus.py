"""The SynthDense corpus on disk: one record per scene from (seed, split, index), rendered by a pool of
processes and written in the generic format; `manifest`/`identity` say which config made a corpus, `ensure`
reuses a matching one (the layout: the package docstring).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

from sharpclip import owned_files
from sharpclip.config import SynthDenseConfig
from sharpclip.data.synthdense.captions import coarse_caption, dense_caption, family, noisy_details, vocabulary
from sharpclip.data.synthdense.edits import EDIT_KINDS, MMVP_PATTERNS, make_edit, mmvp_pair
from sharpclip.data.synthdense.render import render
from sharpclip.data.synthdense.scene import (
    ATTRIBUTES,
    BACKGROUNDS,
    COLOURS,
    DETAILS,
    SHAPES,
    SIZES,
    TEXTURES,
    Obj,
    Scene,
    random_scene,
)

VERSION = 3  # bump when the output for a given config changes (2: caption_layout, test_variants; 3: detail pairs,
# caption_noisy, zero-shot classes)
SPLITS = ("train", "test", "pretrain", "edits", "mmvp", "zeroshot")  # one JSONL file and one image folder each
ZEROSHOT_CLASSES = tuple(f"{c}_{s}" for c in COLOURS for s in SHAPES)  # folder names; "_" reads as a space
ZEROSHOT_PROMPTS = "zeroshot_prompts.txt"  # the coarse captions' template, one line: eval.prompts
GENERATING = "synthdense.generating.json"  # written first, removed once manifest.json is written: a build in progress


def _rng(seed: int, split: str, index: int) -> random.Random:
    return random.Random(f"{seed}:{split}:{index}")


def _detail_family(cfg: SynthDenseConfig, split: str, index: int) -> bool:
    """Whether this family's near-duplicates change only size and texture (a test family under `details`, or one of
    the `train_detail_pairs` / `pretrain_detail_pairs`, indexed after the `train_families` / `pretrain_scenes`)."""
    if split == "test":
        return cfg.test_variants == "details"
    if split == "pretrain":
        return index >= cfg.pretrain_scenes
    return split == "train" and index >= cfg.train_families


def _noisy(cfg: SynthDenseConfig, split: str, key: int, scene: Scene) -> Scene:
    draws, coin = _rng(cfg.seed, f"{split}-noisy", key), _rng(cfg.seed, f"{split}-noisy-coin", key)
    return noisy_details(scene, draws, cfg.detail_random_p, coin)


def _pair_records(cfg: SynthDenseConfig, split: str, index: int, fam_size: int) -> Iterator[tuple[dict, Scene]]:
    attributes = DETAILS if _detail_family(cfg, split, index) else ATTRIBUTES
    objects = cfg.test_changed_objects if split == "test" else 1
    scenes = family(_rng(cfg.seed, split, index), fam_size, cfg.min_objects, cfg.max_objects, attributes, objects)
    for v, scene in enumerate(scenes):
        rid = f"{split}-{index:06d}-{v}"
        yield (
            {
                "id": rid,
                "image": f"images/{split}/{rid}.png",
                "caption": dense_caption(scene),
                "caption_layout": dense_caption(scene, details=False),
                "caption_noisy": dense_caption(_noisy(cfg, split, index * 8 + v, scene)),
                "short_caption": coarse_caption(scene, "colours"),
                "caption_shapes": coarse_caption(scene, "shapes"),
                "caption_colours": coarse_caption(scene, "colours"),
                "group": f"{split}-{index:06d}",
                "variant": v,
            },
            scene,
        )


def _edit_records(cfg: SynthDenseConfig, index: int) -> Iterator[tuple[dict, Scene]]:
    rng = _rng(cfg.seed, "edits", index)
    kind = EDIT_KINDS[index % len(EDIT_KINDS)]
    lo = cfg.min_objects + (kind == "remove")  # keep at least min_objects after a removal when possible
    source = random_scene(rng, min(lo, cfg.max_objects), cfg.max_objects)
    target, instruction = make_edit(source, rng, kind)
    rid = f"edit-{index:06d}"
    yield (
        {
            "id": rid,
            "source_image": f"images/edits/{rid}-source.png",
            "edited_image": f"images/edits/{rid}-edited.png",
            "source_caption": dense_caption(source),
            "target_caption": dense_caption(target),
            "instruction": instruction,
            "kind": kind,
        },
        source,
    )
    yield {}, target


def _mmvp_records(cfg: SynthDenseConfig, index: int) -> Iterator[tuple[dict, Scene]]:
    pattern = MMVP_PATTERNS[index % len(MMVP_PATTERNS)]
    a, b, text_a, text_b = mmvp_pair(pattern, _rng(cfg.seed, "mmvp", index), cfg.min_objects, cfg.max_objects)
    for half, scene, text in (("a", a, text_a), ("b", b, text_b)):
        rid = f"mmvp-{index:06d}-{half}"
        yield (
            {
                "id": rid,
                "image": f"images/mmvp/{rid}.png",
                "caption": text,
                "group": f"mmvp-{index:06d}",
                "pattern": pattern,
            },
            scene,
        )


def _zeroshot_records(cfg: SynthDenseConfig, index: int) -> Iterator[tuple[dict, Scene]]:
    """Image `index` of the zero-shot set: class index mod 64, one object of that colour and shape."""
    rng = _rng(cfg.seed, "zeroshot", index)
    label = ZEROSHOT_CLASSES[index % len(ZEROSHOT_CLASSES)]
    colour, shape = label.split("_")
    obj = Obj(shape, colour, rng.choice(SIZES), rng.choice(TEXTURES), rng.randrange(9))
    scene = Scene(rng.choice(list(BACKGROUNDS)), (obj,))
    yield {"id": f"zeroshot-{index:06d}", "image": f"images/zeroshot/{label}/{index:06d}.png", "label": label}, scene


def _jobs(cfg: SynthDenseConfig) -> list[tuple[str, int]]:
    jobs = [("train", i) for i in range(cfg.train_families + cfg.train_detail_pairs)]
    jobs += [("test", i) for i in range(cfg.test_families)]
    jobs += [("pretrain", i) for i in range(cfg.pretrain_scenes + cfg.pretrain_detail_pairs)]
    jobs += [("edits", i) for i in range(cfg.edits)]
    jobs += [("mmvp", i) for i in range(cfg.mmvp_pairs * len(MMVP_PATTERNS))]
    return jobs + [("zeroshot", i) for i in range(cfg.zeroshot_per_class * len(ZEROSHOT_CLASSES))]


def _records(cfg: SynthDenseConfig, split: str, index: int) -> Iterator[tuple[dict, Scene]]:
    if split == "edits":
        return _edit_records(cfg, index)
    if split == "mmvp":
        return _mmvp_records(cfg, index)
    if split == "zeroshot":
        return _zeroshot_records(cfg, index)
    size = {"train": cfg.train_family_size, "test": cfg.test_family_size, "pretrain": 1}[split]
    if split in ("train", "pretrain") and _detail_family(cfg, split, index):
        size = 2  # a detail pair
    return _pair_records(cfg, split, index, size)


def _work(args: tuple[SynthDenseConfig, str, list[tuple[str, int]]]) -> list[tuple[str, dict]]:
    """Render and save one chunk of jobs (in a worker); returns (split, record) per record."""
    cfg, root, jobs = args
    out = []
    for split, index in jobs:
        records = list(_records(cfg, split, index))
        paths = (
            [r.get("image") for r, _ in records]
            if split != "edits"
            else [records[0][0]["source_image"], records[0][0]["edited_image"]]
        )
        for path, (_, scene) in zip(paths, records, strict=True):
            (Path(root) / path).parent.mkdir(parents=True, exist_ok=True)  # zero-shot: a folder per class
            render(scene, cfg.resolution).save(Path(root) / path, compress_level=1)
        out += [(split, r) for r, _ in records if r]
    return out


def _map(fn: Callable, chunks: list, workers: int) -> Iterator:
    if workers <= 1:
        return map(fn, chunks)
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"  # fork: workers need no re-import
    pool = mp.get_context(method).Pool(workers)
    return _closing(pool, pool.imap(fn, chunks))


def _closing(pool, it: Iterator) -> Iterator:
    with pool:
        yield from it


# fields added after VERSION 3 with the value that reproduces version 3's output: at that value a field is left out
# of a corpus's identity, so corpora (and caches keyed on them) made before the field existed stay valid
LATER_FIELDS = {"detail_random_p": 1.0, "pretrain_detail_pairs": 0, "test_changed_objects": 1}


def identity(cfg: SynthDenseConfig) -> dict:
    """The config values that determine the corpus: every field but `workers` and LATER_FIELDS at their old value."""
    config = {k: v for k, v in asdict(cfg).items() if k != "workers"}
    return {k: v for k, v in config.items() if not (k in LATER_FIELDS and v == LATER_FIELDS[k])}


def manifest(cfg: SynthDenseConfig) -> dict:
    """What identifies a corpus: generator version and every size (not the number of rendering processes)."""
    return {"generator": "sharpclip.synthdense", "version": VERSION, "config": identity(cfg)}


def generate(root: str | Path, cfg: SynthDenseConfig) -> Path:
    """Write the corpus under `root` (layout: the package docstring); returns root. Output depends only on `cfg`."""
    root = Path(root)
    owned_files.write_text(root / GENERATING, json.dumps(manifest(cfg)) + "\n", "data.root")  # ours, until done
    for split in SPLITS:
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
    jobs = _jobs(cfg)
    step = max(1, min(500, len(jobs) // (4 * max(1, cfg.workers)) + 1))
    chunks = [(cfg, str(root), jobs[i : i + step]) for i in range(0, len(jobs), step)]
    with ExitStack() as stack:
        files = {s: stack.enter_context(open(root / f"{s}.jsonl", "w", encoding="utf-8")) for s in SPLITS}
        for chunk in _map(_work, chunks, cfg.workers):
            for split, record in chunk:
                files[split].write(json.dumps(record) + "\n")
    (root / "vocab.txt").write_text("\n".join(vocabulary()) + "\n", encoding="utf-8")
    (root / ZEROSHOT_PROMPTS).write_text("a picture of a {}.\n", encoding="utf-8")
    (root / "manifest.json").write_text(json.dumps(manifest(cfg), indent=2) + "\n", encoding="utf-8")
    owned_files.remove(root / GENERATING, "data.root")
    return root


def refuse_foreign(root: Path) -> None:
    """Refuse (ValueError, one line) to generate into a folder that holds anything but an interrupted generation of
    sharpclip's own (its `GENERATING` record): a user's data folder given as data.root (or a demo's --out holding a
    `synthdense/` of the user's) is never written over."""
    if (root.exists() or root.is_symlink()) and not root.is_dir():
        raise ValueError(f"{root}: not a folder; choose another data.root (the demo: another --out)")
    names = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    names = [n for n in names if n != owned_files.REGISTRY and not owned_files.is_temporary(n)]  # a start in flight
    if names and not owned_files.is_ours(root / GENERATING):
        raise ValueError(
            f"{root}: holds {', '.join(names[:3])} but no SynthDense manifest.json: not a corpus sharpclip generated, "
            "nothing there is touched; choose another data.root (the demo: another --out), or an empty folder"
        )


def ensure(root: str | Path, cfg: SynthDenseConfig) -> Path:
    """Generate under `root` unless a corpus for this exact config is already there; a different one is an error."""
    root = Path(root)
    path = root / "manifest.json"
    if path.is_file():
        try:
            found = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:  # truncated by a full disk or a crash while copying
            raise ValueError(
                f"{path}: unreadable SynthDense manifest ({err}); delete the folder {root} to regenerate it"
            ) from None
        if not isinstance(found, dict):
            raise ValueError(f"{path}: not a SynthDense manifest; delete the folder {root} to regenerate it")
        if found == manifest(cfg):
            return root
        raise ValueError(
            f"{path}: SynthDense there was generated with a different config ({found.get('config')}); "
            "use another data.root or delete the folder to regenerate"
        )
    refuse_foreign(root)
    return generate(root, cfg)
