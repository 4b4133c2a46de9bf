"""SynthDense captions: dense (every object, relation and count), layout-only, noisy-detail and coarse captions,
families of near-duplicates whose dense captions differ, and the corpus's vocabulary.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from itertools import combinations, pairwise

from sharpclip.data.synthdense.scene import (
    ATTRIBUTES,
    BACKGROUNDS,
    CELL_NAMES,
    CELL_PREPOSITIONS,
    COLOURS,
    NUMBERS,
    PLURALS,
    SHAPES,
    SIZES,
    TEXTURES,
    Obj,
    Scene,
    near_duplicate,
    random_scene,
)

MIN_DENSE_WORDS = 80


def object_name(o: Obj) -> str:
    """'the red circle': how captions, instructions and relations name an object (unique in its scene)."""
    return f"the {o.colour} {o.shape}"


def where(cell: int) -> str:
    """'in the top left corner': a grid cell as a caption places it."""
    return f"{CELL_PREPOSITIONS[cell]} {CELL_NAMES[cell]}"


def _relation(a: Obj, b: Obj) -> str:
    """'The red circle is above and left of the blue star.' from grid rows and columns."""
    (ra, ca), (rb, cb) = divmod(a.cell, 3), divmod(b.cell, 3)
    vertical = "above" if ra < rb else "below" if ra > rb else ""
    horizontal = "left of" if ca < cb else "right of" if ca > cb else ""
    if vertical and horizontal:
        return f"{object_name(a).capitalize()} is {vertical} and {horizontal} {object_name(b)}."
    return f"{object_name(a).capitalize()} is {vertical or horizontal} {object_name(b)}."


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
    parts += [f"{where(o.cell).capitalize()} there is a {look(o)}." for o in objs]
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
