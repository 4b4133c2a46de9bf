"""SynthDense: procedurally drawn scenes with dense compositional captions, the project's embedded default task.

Why: no pretrained weights or benchmark images exist here, yet HN-CLIP's claim (near-duplicate captions stay
confused after coarse pre-training) needs long captions that share most of their words. SynthDense builds exactly that
(what the demo measures with it: docs/reproduction.md).

A scene is a background and 3-5 objects, each with a shape (8), colour (8), size (2), texture (3) and a cell of a 3×3
grid. Everything is a pure function of (seed, split, index): `random.Random(f"{seed}:{split}:{index}")`.

- Families: a base scene plus near-duplicates that change one (60 %) or two attributes of one object (test
  families: of each of `test_changed_objects` objects, 1 by default).
- Captions: dense (≥ 80 words: background, every object with all attributes and position in reading order, the
  relation of each object to the next in reading order, counts; more relations or a closing sentence are added until
  the caption reaches 80 words), two variants of it (`caption_layout` without the objects' size and texture;
  `caption_noisy` with each size and texture word drawn at random, unrelated to the image, with probability
  `detail_random_p`, 1 by default) and two coarse levels, `shapes`
  ("a picture of a circle, a square and a star.") and `colours` ("a picture of a red circle, ...").
- Edits (CLIP-IN / UltraEdit style): change colour, shape, size or position of an object, add or remove one; source
  and target images with their dense captions and the instruction.
- MMVP-style pairs: two images that differ in one visual pattern (colour, count, position, size, presence, texture),
  each with a statement true of it only.
- Zero-shot classes: single-object scenes, one class per colour + shape ("red circle", 64 classes), any size,
  texture, cell and background; read by the `zeroshot` evaluation suite as an image folder with the coarse captions'
  prompt ("a picture of a {}.").

`generate(root, cfg)` writes it in the generic format (so the ordinary loaders read it):

    root/manifest.json, vocab.txt, images/<split>/<index>.png,
    train.jsonl, test.jsonl, pretrain.jsonl   {id, image, caption, caption_layout, caption_noisy, short_caption,
                                               caption_shapes, caption_colours, group, variant}
    edits.jsonl                               {id, source_image, edited_image, source_caption, target_caption,
                                               instruction, kind}
    mmvp.jsonl                                {id, image, caption, group, pattern}  (two rows per pair)
    zeroshot.jsonl, images/zeroshot/<colour>_<shape>/<index>.png, zeroshot_prompts.txt
                                              {id, image, label}
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from itertools import combinations, pairwise
from pathlib import Path

from PIL import Image, ImageChops, ImageDraw

from sharpclip.config import SynthDenseConfig

VERSION = 3  # bump when the output for a given config changes (2: caption_layout, test_variants; 3: detail pairs,
# caption_noisy, zero-shot classes)
SHAPES = ("circle", "square", "triangle", "diamond", "pentagon", "hexagon", "star", "cross")
PLURALS = {s: s + ("es" if s == "cross" else "s") for s in SHAPES}
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 100, 235),
    "yellow": (240, 220, 40),
    "purple": (150, 60, 200),
    "orange": (245, 140, 30),
    "cyan": (40, 210, 220),
    "white": (245, 245, 245),
}
BACKGROUNDS = {"black": (15, 15, 15), "gray": (115, 115, 115), "brown": (95, 65, 40), "navy": (20, 25, 80)}
SIZES = ("small", "large")
TEXTURES = ("solid", "striped", "dotted")
CELL_NAMES = (
    "top left corner",
    "top",
    "top right corner",
    "left",
    "center",
    "right",
    "bottom left corner",
    "bottom",
    "bottom right corner",
)
CELL_PREPOSITIONS = ("in the", "at the", "in the", "on the", "in the", "on the", "in the", "at the", "in the")
NUMBERS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ATTRIBUTES = ("colour", "shape", "size", "texture", "position")
DETAILS = ("size", "texture")  # what `caption_layout` leaves out; `test_variants: details` families differ only here
EDIT_KINDS = ("colour", "shape", "size", "position", "add", "remove")
MMVP_PATTERNS = ("colour", "count", "position", "size", "presence", "texture")
MIN_DENSE_WORDS = 80
SPLITS = ("train", "test", "pretrain", "edits", "mmvp", "zeroshot")  # one JSONL file and one image folder each
ZEROSHOT_CLASSES = tuple(f"{c}_{s}" for c in COLOURS for s in SHAPES)  # folder names; "_" reads as a space
ZEROSHOT_PROMPTS = "zeroshot_prompts.txt"  # the coarse captions' template, one line: eval.prompts


@dataclass(frozen=True)
class Obj:
    shape: str
    colour: str
    size: str
    texture: str
    cell: int  # 0..8, reading order on the 3×3 grid


@dataclass(frozen=True)
class Scene:
    background: str
    objects: tuple[Obj, ...]  # sorted by cell

    def with_objects(self, objects: list[Obj] | tuple[Obj, ...]) -> Scene:
        """The same background with `objects`, sorted by cell."""
        return Scene(self.background, tuple(sorted(objects, key=lambda o: o.cell)))


# ---------------------------------------------------------------- scenes


def random_scene(rng: random.Random, n_min: int, n_max: int) -> Scene:
    """n objects in distinct cells with distinct (colour, shape), so "the red circle" names one object."""
    n = rng.randint(n_min, n_max)
    kinds = rng.sample([(c, s) for c in COLOURS for s in SHAPES], n)
    cells = rng.sample(range(9), n)
    objs = [Obj(s, c, rng.choice(SIZES), rng.choice(TEXTURES), cell) for (c, s), cell in zip(kinds, cells, strict=True)]
    return Scene(rng.choice(list(BACKGROUNDS)), ()).with_objects(objs)


def _valid(objects: list[Obj]) -> bool:
    return len({o.cell for o in objects}) == len(objects) and len({(o.colour, o.shape) for o in objects}) == len(
        objects
    )


def change(scene: Scene, i: int, attribute: str, rng: random.Random) -> Scene | None:
    """The scene with object i's `attribute` set to a different value, or None when no valid value exists."""
    obj = scene.objects[i]
    pools = {"colour": COLOURS, "shape": SHAPES, "size": SIZES, "texture": TEXTURES, "position": range(9)}
    field_name = "cell" if attribute == "position" else attribute
    values = [v for v in pools[attribute] if v != getattr(obj, field_name)]
    rng.shuffle(values)
    for value in values:
        objects = list(scene.objects)
        objects[i] = replace(obj, **{field_name: value})
        if _valid(objects):
            return scene.with_objects(objects)
    return None


def _changed(before: Scene, after: Scene) -> Obj:
    """The one object of `after` that `change` produced."""
    return next(o for o in after.objects if o not in before.objects)


def _change_object(scene: Scene, obj: Obj, attributes: tuple[str, ...], rng: random.Random) -> Scene | None:
    """Change one (60 %) or two of `attributes` of the object `obj` of `scene`; None when no valid value exists."""
    out: Scene | None = scene
    i = scene.objects.index(obj)
    for attribute in rng.sample(attributes, min(len(attributes), 1 if rng.random() < 0.6 else 2)):
        before, out = out, change(out, i, attribute, rng)
        if out is None:
            return None
        i = out.objects.index(_changed(before, out))
    return out


def near_duplicate(
    scene: Scene, rng: random.Random, attributes: tuple[str, ...] = ATTRIBUTES, objects: int = 1
) -> Scene:
    """Change one (60 %) or two of `attributes` of each of `objects` distinct objects (all of them when the scene has
    fewer); retries until the result is valid and differs."""
    for _ in range(50):
        out: Scene | None = scene
        if objects == 1:  # one draw of the object, as before multi-object changes existed (the corpora stay the same)
            out = _change_object(scene, scene.objects[rng.randrange(len(scene.objects))], attributes, rng)
        else:
            picked = [scene.objects[i] for i in rng.sample(range(len(scene.objects)), min(objects, len(scene.objects)))]
            for obj in picked:  # objects are unique by colour and shape, so a picked one is found after others change
                if out is None:
                    break
                out = _change_object(out, obj, attributes, rng)
        if out is not None and out != scene:
            return out
    raise RuntimeError("could not make a near-duplicate scene")  # unreachable for 3x3 grids with <= 8 objects


def family(
    rng: random.Random, size: int, n_min: int, n_max: int, attributes: tuple[str, ...] = ATTRIBUTES, objects: int = 1
) -> list[Scene]:
    """A base scene and size-1 distinct near-duplicates of it, each changing `attributes` of `objects` objects."""
    scenes = [random_scene(rng, n_min, n_max)]
    while len(scenes) < size:
        variant = near_duplicate(scenes[0], rng, attributes, objects)
        if variant not in scenes and dense_caption(variant) not in {dense_caption(s) for s in scenes}:
            scenes.append(variant)
    return scenes


# ---------------------------------------------------------------- captions


def _name(o: Obj) -> str:
    return f"the {o.colour} {o.shape}"


def _where(cell: int) -> str:
    return f"{CELL_PREPOSITIONS[cell]} {CELL_NAMES[cell]}"


def _relation(a: Obj, b: Obj) -> str:
    """'The red circle is above and left of the blue star.' from grid rows and columns."""
    (ra, ca), (rb, cb) = divmod(a.cell, 3), divmod(b.cell, 3)
    vertical = "above" if ra < rb else "below" if ra > rb else ""
    horizontal = "left of" if ca < cb else "right of" if ca > cb else ""
    if vertical and horizontal:
        return f"{_name(a).capitalize()} is {vertical} and {horizontal} {_name(b)}."
    return f"{_name(a).capitalize()} is {vertical or horizontal} {_name(b)}."


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _counts(scene: Scene) -> str:
    counts = Counter(o.shape for o in scene.objects)
    parts = [f"{NUMBERS[n]} {PLURALS[s] if n > 1 else s}" for s, n in sorted(counts.items())]
    return f"In total the picture has {_listing(parts)}."


def dense_caption(scene: Scene, details: bool = True) -> str:
    """≥ 80 words: every object with all attributes in reading order, relations along reading order, counts.

    details=False: the layout caption, without the DETAILS (size, texture) of the objects (stage A2's captions)."""
    objs = scene.objects
    parts = [f"The picture shows {NUMBERS[len(objs)]} shapes on a {scene.background} background."]
    look = (lambda o: f"{o.size} {o.texture} {o.colour} {o.shape}") if details else (lambda o: f"{o.colour} {o.shape}")
    parts += [f"{_where(o.cell).capitalize()} there is a {look(o)}." for o in objs]
    chain = list(pairwise(objs))
    parts += [_relation(a, b) for a, b in chain] + [_counts(scene)]
    extra = [p for p in combinations(objs, 2) if p not in chain]
    while len(" ".join(parts).split()) < MIN_DENSE_WORDS:
        parts.insert(
            -1, _relation(*extra.pop(0)) if extra else f"The rest of the {scene.background} background is empty."
        )
    return " ".join(parts)


def noisy_details(scene: Scene, rng: random.Random, p: float = 1.0, coin: random.Random | None = None) -> Scene:
    """The scene with each object's size and each texture word drawn anew with probability `p` (independently per
    word; `coin` decides, `rng` draws), else kept: what `caption_noisy` describes (alt-text that names details
    unreliably). A drawn word may equal the image's by chance, so a word is wrong with probability p · (1 − 1/k) for
    k values (sizes: 2, textures: 3). The draws from `rng` are the same at every `p`, so p = 1 is the caption that
    always drew every detail at random, and p = 0 the true one."""
    coin = coin or random.Random(0)
    objects = []
    for o in scene.objects:
        size, texture = rng.choice(SIZES), rng.choice(TEXTURES)
        keep_size, keep_texture = coin.random() >= p, coin.random() >= p  # random() < 1: p = 1 never keeps
        objects.append(replace(o, size=o.size if keep_size else size, texture=o.texture if keep_texture else texture))
    return scene.with_objects(objects)


def coarse_caption(scene: Scene, level: str) -> str:
    """level `shapes`: 'a picture of a circle and a star.'; `colours`: 'a picture of a red circle and a blue star.'"""
    words = [f"a {o.shape}" if level == "shapes" else f"a {o.colour} {o.shape}" for o in scene.objects]
    return f"a picture of {_listing(words)}."


# ---------------------------------------------------------------- edits and MMVP pairs


def _edit_change(scene: Scene, rng: random.Random, kind: str) -> tuple[Scene, str] | None:
    i = rng.randrange(len(scene.objects))
    o = scene.objects[i]
    out = change(scene, i, kind, rng)
    if out is None:
        return None
    new = _changed(scene, out)
    text = {
        "colour": f"change the colour of {_name(o)} to {new.colour}",
        "shape": f"turn {_name(o)} into a {new.shape}",
        "size": f"make {_name(o)} {new.size}",
        "position": f"move {_name(o)} to the {CELL_NAMES[new.cell]}",
    }[kind]
    return out, text


def _edit_add(scene: Scene, rng: random.Random) -> tuple[Scene, str] | None:
    free = [c for c in range(9) if c not in {o.cell for o in scene.objects}]
    used = {(o.colour, o.shape) for o in scene.objects}
    kinds = [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in used]
    if not free:
        return None
    (c, s), cell = rng.choice(kinds), rng.choice(free)
    new = Obj(s, c, rng.choice(SIZES), rng.choice(TEXTURES), cell)
    return scene.with_objects([*scene.objects, new]), f"add a {new.size} {new.texture} {c} {s} {_where(cell)}"


def make_edit(scene: Scene, rng: random.Random, kind: str) -> tuple[Scene, str]:
    """(edited scene, instruction) for one of EDIT_KINDS."""
    if kind == "add":
        got = _edit_add(scene, rng)
    elif kind == "remove":
        o = rng.choice(scene.objects)
        got = scene.with_objects([x for x in scene.objects if x != o]), f"remove {_name(o)}"
    else:
        got = _edit_change(scene, rng, kind)
    if got is None:
        raise RuntimeError(f"no {kind} edit possible for {scene}")
    return got


def _unique_shape_scene(rng: random.Random, n_min: int, n_max: int) -> Scene:
    while True:
        scene = random_scene(rng, n_min, n_max)
        if len({o.shape for o in scene.objects}) == len(scene.objects):
            return scene


def _mmvp_count(rng: random.Random, n_min: int) -> tuple[Scene, Scene, str, str]:
    shape, k = rng.choice(SHAPES), rng.randint(1, 3)
    colours = rng.sample(list(COLOURS), k + 1)
    cells = rng.sample(range(9), k + 1 + max(0, n_min - k - 1))
    others = [s for s in SHAPES if s != shape]
    objs = [Obj(shape, colours[j], rng.choice(SIZES), rng.choice(TEXTURES), cells[j]) for j in range(k + 1)]
    fill = [
        Obj(rng.choice(others), rng.choice(list(COLOURS)), rng.choice(SIZES), rng.choice(TEXTURES), c)
        for c in cells[k + 1 :]
    ]
    bg = rng.choice(list(BACKGROUNDS))
    a, b = Scene(bg, ()).with_objects(objs[:k] + fill), Scene(bg, ()).with_objects(objs + fill)
    noun = lambda n: PLURALS[shape] if n > 1 else shape  # noqa: E731
    return a, b, f"there {'are' if k > 1 else 'is'} {NUMBERS[k]} {noun(k)}", f"there are {NUMBERS[k + 1]} {noun(k + 1)}"


def _mmvp_position(scene: Scene, rng: random.Random) -> tuple[Scene, Scene, str, str] | None:
    used = {o.cell for o in scene.objects}
    movable = [(i, o) for i, o in enumerate(scene.objects) if o.cell % 3 == 0 and o.cell + 2 not in used]
    if not movable:
        return None
    i, o = rng.choice(movable)
    objects = list(scene.objects)
    objects[i] = replace(o, cell=o.cell + 2)
    return scene, scene.with_objects(objects), f"the {o.shape} is on the left", f"the {o.shape} is on the right"


def mmvp_pair(pattern: str, rng: random.Random, n_min: int, n_max: int) -> tuple[Scene, Scene, str, str]:
    """(image A, image B, statement true of A only, statement true of B only) for one visual pattern."""
    if pattern == "count":
        return _mmvp_count(rng, n_min)
    while True:
        scene = _unique_shape_scene(rng, n_min, n_max)
        if pattern == "position":
            got = _mmvp_position(scene, rng)
            if got is not None:
                return got
            continue
        i = rng.randrange(len(scene.objects))
        o = scene.objects[i]
        if pattern == "presence":
            others = [x for x in scene.objects if x != o]
            return scene, scene.with_objects(others), f"there is a {o.shape}", f"there is no {o.shape}"
        b = change(scene, i, pattern, rng)
        if b is not None:
            new = _changed(scene, b)
            a_word, b_word = getattr(o, pattern), getattr(new, pattern)
            return scene, b, f"the {o.shape} is {a_word}", f"the {o.shape} is {b_word}"


# ---------------------------------------------------------------- vocabulary


def vocabulary() -> list[str]:
    """Every word (and punctuation mark) the captions, instructions and statements can use, sorted."""
    templates = (
        "the picture shows shapes on a background . in at there is a , and to of above below left right "
        "in total has the rest of is empty . a picture of change colour turn into make move add remove "
        "there are no is on"
    )
    words = set(templates.split()) | {",", "."}
    words |= set(SHAPES) | set(PLURALS.values()) | set(COLOURS) | set(BACKGROUNDS) | set(SIZES) | set(TEXTURES)
    words |= set(NUMBERS) | {w for name in CELL_NAMES for w in name.split()}
    words |= {w for p in CELL_PREPOSITIONS for w in p.split()}
    return sorted(words)


# ---------------------------------------------------------------- rendering


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    import math

    if shape in ("pentagon", "hexagon"):
        k = 5 if shape == "pentagon" else 6
        return [(cx + r * math.sin(2 * math.pi * j / k), cy - r * math.cos(2 * math.pi * j / k)) for j in range(k)]
    if shape == "star":
        return [
            (
                cx + (r if j % 2 == 0 else 0.45 * r) * math.sin(math.pi * j / 5),
                cy - (r if j % 2 == 0 else 0.45 * r) * math.cos(math.pi * j / 5),
            )
            for j in range(10)
        ]
    unit = {
        "square": [(-0.8, -0.8), (0.8, -0.8), (0.8, 0.8), (-0.8, 0.8)],
        "triangle": [(0, -1), (0.95, 0.8), (-0.95, 0.8)],
        "diamond": [(0, -1), (0.75, 0), (0, 1), (-0.75, 0)],
        "cross": [
            (-0.3, -1),
            (0.3, -1),
            (0.3, -0.3),
            (1, -0.3),
            (1, 0.3),
            (0.3, 0.3),
            (0.3, 1),
            (-0.3, 1),
            (-0.3, 0.3),
            (-1, 0.3),
            (-1, -0.3),
            (-0.3, -0.3),
        ],
    }[shape]
    return [(cx + r * x, cy + r * y) for x, y in unit]


@lru_cache(maxsize=8)
def _texture_mask(texture: str, res: int) -> Image.Image:
    """255 where the texture's darker pattern shows: diagonal stripes or a grid of dots."""
    mask = Image.new("L", (res, res), 0)
    draw = ImageDraw.Draw(mask)
    period = max(4, res // 12)
    if texture == "striped":
        for k in range(-res, res, period):
            draw.line([(k, 0), (k + res, res)], fill=255, width=max(1, period // 2))
    elif texture == "dotted":
        dot = max(1, period // 3)
        for y in range(period // 2, res, period):
            for x in range(period // 2, res, period):
                draw.ellipse([x - dot, y - dot, x + dot, y + dot], fill=255)
    return mask


def render(scene: Scene, res: int) -> Image.Image:
    """The scene drawn at res×res: one third of the side per grid cell; large = 90 %, small = 50 % of a half cell."""
    image = Image.new("RGB", (res, res), BACKGROUNDS[scene.background])
    cell = res / 3
    for o in scene.objects:
        row, col = divmod(o.cell, 3)
        cx, cy, r = (col + 0.5) * cell, (row + 0.5) * cell, cell / 2 * (0.9 if o.size == "large" else 0.5)
        mask = Image.new("L", (res, res), 0)
        draw = ImageDraw.Draw(mask)
        if o.shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
        else:
            draw.polygon(_polygon(o.shape, cx, cy, r), fill=255)
        image.paste(COLOURS[o.colour], mask=mask)
        if o.texture != "solid":
            dark = tuple(int(v * 0.35) for v in COLOURS[o.colour])
            image.paste(dark, mask=ImageChops.multiply(mask, _texture_mask(o.texture, res)))
    return image


# ---------------------------------------------------------------- the corpus on disk


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
    """Write the corpus under `root` (see the module docstring); returns root. Output depends only on `cfg`."""
    root = Path(root)
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
    return root


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
    return generate(root, cfg)
