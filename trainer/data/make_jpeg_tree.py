"""Write an ImageNet-like JPEG tree of generated images, for benchmarks and tests:

    python -m trainer.data.make_jpeg_tree OUT --classes 100 --per-class 50 --val-per-class 10 --size 500x375

OUT/train/class_000/00000.jpg ..., OUT/val/class_000/... Each class has stripes of its own
orientation and color (gratings.py); each image's size varies by up
to 10% around --size, as photos do, so the decoder never sees one shape only.
"""
import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from trainer.data.gratings import ORIENTATIONS, gratings, hues

SIZE_JITTER = 0.1
NOISE = 0.08  # lower than the synthetic set's: noise makes JPEGs large, photos are smoother


def write_image(path: Path, label: int, classes: int, width: int, height: int, seed: int, quality: int):
    rng = np.random.default_rng([seed, label, int(path.stem), int(path.parent.parent.name == "val")])
    w, h = (round(s * rng.uniform(1 - SIZE_JITTER, 1 + SIZE_JITTER)) for s in (width, height))
    hue = hues(-(-classes // 2))[label // 2]
    pixels = gratings(ORIENTATIONS[[label % 2]], np.array([hue]), rng, h, w, NOISE)[0]
    Image.fromarray(pixels).save(path, quality=quality)


def write_tree(out: Path, classes: int, per_class: int, val_per_class: int, width: int = 500,
               height: int = 375, seed: int = 0, quality: int = 90, jobs: int = 0) -> None:
    todo = []
    for split, count in (("train", per_class), ("val", val_per_class)):
        for label in range(classes):
            folder = out / split / f"class_{label:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            todo += [(folder / f"{i:05d}.jpg", label) for i in range(count)]
    # numpy and the JPEG encoder release the GIL: threads use every core
    with ThreadPoolExecutor(jobs or os.cpu_count()) as pool:
        list(pool.map(lambda job: write_image(*job, classes, width, height, seed, quality), todo))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--per-class", type=int, default=50, help="training images per class")
    p.add_argument("--val-per-class", type=int, default=10)
    p.add_argument("--size", default="500x375", help="WIDTHxHEIGHT around which sizes vary")
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=0, help="threads (0: one per core)")
    a = p.parse_args(argv)
    try:
        width, height = (int(v) for v in a.size.lower().split("x"))
    except ValueError:
        p.error(f"--size {a.size!r} is not WIDTHxHEIGHT, e.g. 500x375")
    write_tree(a.out, a.classes, a.per_class, a.val_per_class, width, height, a.seed, a.quality, a.jobs)
    print(f"wrote {a.classes * (a.per_class + a.val_per_class)} images to {a.out}")


if __name__ == "__main__":
    main()
