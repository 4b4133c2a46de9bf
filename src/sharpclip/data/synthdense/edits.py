"""SynthDense edit pairs (CLIP-IN / UltraEdit style instructions) and MMVP-style pairs that differ in one visual
pattern, each with a statement true of one image only.
"""

from __future__ import annotations

import random
from dataclasses import replace

from sharpclip.data.synthdense.captions import object_name, where
from sharpclip.data.synthdense.scene import (
    BACKGROUNDS,
    CELL_NAMES,
    COLOURS,
    NUMBERS,
    PLURALS,
    SHAPES,
    SIZES,
    TEXTURES,
    Obj,
    Scene,
    change,
    changed_object,
    random_scene,
)

EDIT_KINDS = ("colour", "shape", "size", "position", "add", "remove")
MMVP_PATTERNS = ("colour", "count", "position", "size", "presence", "texture")


def _edit_change(scene: Scene, rng: random.Random, kind: str) -> tuple[Scene, str] | None:
    i = rng.randrange(len(scene.objects))
    o = scene.objects[i]
    out = change(scene, i, kind, rng)
    if out is None:
        return None
    new = changed_object(scene, out)
    text = {
        "colour": f"change the colour of {object_name(o)} to {new.colour}",
        "shape": f"turn {object_name(o)} into a {new.shape}",
        "size": f"make {object_name(o)} {new.size}",
        "position": f"move {object_name(o)} to the {CELL_NAMES[new.cell]}",
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
    return scene.with_objects([*scene.objects, new]), f"add a {new.size} {new.texture} {c} {s} {where(cell)}"


def make_edit(scene: Scene, rng: random.Random, kind: str) -> tuple[Scene, str]:
    """(edited scene, instruction) for one of EDIT_KINDS."""
    if kind == "add":
        got = _edit_add(scene, rng)
    elif kind == "remove":
        o = rng.choice(scene.objects)
        got = scene.with_objects([x for x in scene.objects if x != o]), f"remove {object_name(o)}"
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
            new = changed_object(scene, b)
            a_word, b_word = getattr(o, pattern), getattr(new, pattern)
            return scene, b, f"the {o.shape} is {a_word}", f"the {o.shape} is {b_word}"
