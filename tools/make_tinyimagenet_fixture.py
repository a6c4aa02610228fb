"""Build a tiny Tiny-ImageNet fixture in the exact tiny-imagenet-200/ layout (tests/data/).

3 classes x 4 train images, 6 val images and 2 unlabelled test images, all 64x64 JPEGs,
plus the files the loader must ignore (words.txt, <wnid>_boxes.txt, test/). wnids.txt is
deliberately not sorted (as in the real file) so tests see the sorted-wnid class rule;
one train image and one val image are grayscale JPEGs, as a few hundred real ones are.
Images are seeded smooth noise (8x8 noise upsampled) tinted by class; nothing is
downloaded. About 30 KB of files.

    python tools/make_tinyimagenet_fixture.py [tests/data/tiny-imagenet-200-fixture]
"""

import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image

WNIDS = {"n01641577": "bullfrog, Rana catesbeiana",  # file order, not sorted
         "n01443537": "goldfish, Carassius auratus",
         "n01629819": "European fire salamander, Salamandra salamandra"}
TINTS = {"n01443537": (1.0, 0.5, 0.1), "n01629819": (0.2, 0.3, 1.0), "n01641577": (0.2, 1.0, 0.2)}
VAL = ["n01629819", "n01443537", "n01641577", "n01443537", "n01641577", "n01629819"]


def image(rng, tint, gray=False) -> Image.Image:
    """A 64x64 RGB (or L) image: 8x8 uniform noise upsampled bicubically, tinted."""
    low = Image.fromarray((rng.random((8, 8)) * 255).astype(np.uint8)).resize((64, 64), Image.BICUBIC)
    base = np.asarray(low, np.float64)
    if gray:
        return Image.fromarray(base.astype(np.uint8), "L")
    rgb = np.stack([base * t + 40 for t in tint], axis=-1)
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")


def box(rng) -> str:
    x0, y0 = rng.integers(0, 20, 2)
    x1, y1 = rng.integers(40, 64, 2)
    return f"{x0}\t{y0}\t{x1}\t{y1}"


def build(root: Path, rng) -> None:
    shutil.rmtree(root, ignore_errors=True)
    (root / "val" / "images").mkdir(parents=True)
    (root / "test" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("".join(f"{w}\n" for w in WNIDS))
    (root / "words.txt").write_text("".join(f"{w}\t{name}\n" for w, name in WNIDS.items()))
    for wnid in WNIDS:
        folder = root / "train" / wnid / "images"
        folder.mkdir(parents=True)
        boxes = []
        for k in range(4):
            gray = wnid == "n01629819" and k == 2
            image(rng, TINTS[wnid], gray).save(folder / f"{wnid}_{k}.JPEG", quality=85)
            boxes.append(f"{wnid}_{k}.JPEG\t{box(rng)}\n")
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text("".join(boxes))
    lines = []
    for k, wnid in enumerate(VAL):
        image(rng, TINTS[wnid], gray=k == 4).save(root / "val" / "images" / f"val_{k}.JPEG", quality=85)
        lines.append(f"val_{k}.JPEG\t{wnid}\t{box(rng)}\n")
    (root / "val" / "val_annotations.txt").write_text("".join(lines))
    for k in range(2):
        image(rng, (1.0, 1.0, 1.0)).save(root / "test" / "images" / f"test_{k}.JPEG", quality=85)


if __name__ == "__main__":
    build(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/tiny-imagenet-200-fixture"),
          np.random.default_rng(200))
