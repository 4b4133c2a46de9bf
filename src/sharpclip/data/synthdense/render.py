"""SynthDense rendering: a scene drawn with PIL, one grid cell per third of the side, textures as dark masks."""

from __future__ import annotations

from functools import lru_cache

from PIL import Image, ImageChops, ImageDraw

from sharpclip.data.synthdense.scene import BACKGROUNDS, COLOURS, Scene


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
