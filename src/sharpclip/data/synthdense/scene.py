"""SynthDense scenes: the attribute values, objects on a 3×3 grid, and the changes that make near-duplicates.

Every draw takes a `random.Random`, so a scene is a pure function of the generator's state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

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


def changed_object(before: Scene, after: Scene) -> Obj:
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
        i = out.objects.index(changed_object(before, out))
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
