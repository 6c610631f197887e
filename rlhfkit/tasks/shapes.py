"""Shapes on a coloured ground: a picture question that text alone cannot answer, for tiny VLMs.

A picture is a square of `size` pixels in one colour (red, green, blue or yellow) with 1 to 3
white squares at random places, one per quarter of the picture. Every row asks the same question,

    {"prompt": "<image>What colour is the background?", "images": ["shapes/train_7.png"],
     "output": "blue", "label": "blue", "count": 2}

so the text carries no information: a policy that ignores the picture is right at most as often
as the most frequent colour (a quarter of the rows, as colours are drawn uniformly). Held-out rows
use pictures never seen in training (another seed: new places and counts).
"""

from __future__ import annotations

import os
import random
from typing import Any

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 205, 20)}
QUESTION = "<image>What colour is the background?"
SIZE = 56  # pixels: 2 x 2 merged 28-pixel patches for Qwen2.5-VL (4 picture tokens)


def draw(colour: str, count: int, rng: random.Random, size: int = SIZE) -> Any:
    """A PIL picture of `colour` with `count` white squares, each in its own quarter of the picture
    (so they never overlap), of side 5/7 of a quarter's, at a random place inside it."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), COLOURS[colour])
    pen = ImageDraw.Draw(img)
    cell = size // 2
    side = cell * 5 // 7
    cells = [(0, 0), (0, 1), (1, 0), (1, 1)]
    rng.shuffle(cells)
    for cx, cy in cells[:count]:
        x0 = cx * cell + rng.randint(0, cell - side)
        y0 = cy * cell + rng.randint(0, cell - side)
        pen.rectangle([x0, y0, x0 + side - 1, y0 + side - 1], fill=(255, 255, 255))
    return img


def shapes_rows(n: int, folder: str, name: str, seed: int, size: int = SIZE) -> list[dict[str, Any]]:
    """`n` rows whose pictures are written to `folder/shapes/{name}_{i}.png` (paths relative to `folder`)."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "shapes"), exist_ok=True)
    rows = []
    for i in range(n):
        colour = rng.choice(list(COLOURS))
        count = rng.randint(1, 3)
        rel = os.path.join("shapes", f"{name}_{i}.png")
        draw(colour, count, rng, size).save(os.path.join(folder, rel))
        rows.append({"prompt": QUESTION, "images": [rel], "output": colour, "label": colour, "count": count})
    return rows


def wrong_colour(colour: str, rng: random.Random) -> str:
    return rng.choice([c for c in COLOURS if c != colour])
