"""How DALI's JPEG decoders fare beside other GPU work, one pipeline variant a row:
1. images/s alone;
2. the time of 3 iterations while a 200 ms sleep kernel runs on another stream (about 200
   ms or more: DALI waits for unrelated work, a device-wide synchronization; less: it does not);
3. images/s while matmuls fill the GPU from another stream, as a training step does.

    python -m trainer.data.make_jpeg_tree /tmp/tree --classes 100 --per-class 130
    python bench/decoder_probe.py /tmp/tree
"""
import sys
import time
from pathlib import Path

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def, types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.data.jpeg_files import list_split  # noqa: E402

BATCH, THREADS, SLEEP_S = 256, 8, 0.2
VARIANTS = ("gpu decoder", "gpu decoder, JPEG engines only", "host decoder", "no decoding")


def pipeline(variant: str, files: list[str], labels: list[int]):
    @pipeline_def(batch_size=BATCH, num_threads=THREADS, device_id=0, exec_dynamic=True, prefetch_queue_depth=3)
    def pipe():
        jpegs, label = fn.readers.file(files=files, labels=labels, random_shuffle=True)
        if variant == "no decoding":  # the GPU operators after decoding, on a fixed photo-sized image
            image = fn.external_source(source=lambda: [np.full((375, 500, 3), 7, np.uint8)] * BATCH, batch=True)
            image = fn.crop(image.gpu(), crop=(300, 300))
        elif variant == "host decoder":
            image = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB).gpu()
        else:
            engines = {"hw_decoder_load": 1.0} if variant.endswith("only") else {}
            image = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB, **engines)
        image = fn.resize(image, size=[224, 224])
        image = fn.crop_mirror_normalize(image, dtype=types.FLOAT16, output_layout="HWC", pad_output=True)
        return image, label.gpu()
    return pipe()


def rate(p, iterations: int = 10) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        p.run()
    return iterations * BATCH / (time.perf_counter() - start)


def main(root: str):
    files, labels, _ = list_split(Path(root) / "train")
    files, labels = files[:16 * BATCH], labels[:16 * BATCH].tolist()
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.half)
    cycles = int(SLEEP_S * 1.98e9)  # the H200's boost clock; the row reads the same at any nearby clock
    print(f"| pipeline | alone | 3 iterations during a {SLEEP_S * 1000:.0f} ms sleep kernel | beside matmuls |")
    for variant in VARIANTS:
        p = pipeline(variant, files, labels)
        p.build()
        for _ in range(8):
            p.run()
        torch.cuda.synchronize()
        alone = rate(p)
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
        start = time.perf_counter()
        for _ in range(3):
            p.run()
        during_sleep = time.perf_counter() - start
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            for _ in range(400):
                a @ a
        busy = rate(p)
        torch.cuda.synchronize()
        print(f"| {variant} | {alone:,.0f} img/s | {1000 * during_sleep:.0f} ms | {busy:,.0f} img/s |", flush=True)
        del p


if __name__ == "__main__":
    main(sys.argv[1])
