"""Where a fresh process's set-up goes for the CIFAR-10 recipe. The suspects are timed one
by one first (CUDA's context, the archive, listing, checks, host decoding, DALI's, Triton's,
dynamo's and inductor's imports, cuSOLVER's first call); the Trainer built after them shows
what set-up is left once they are paid. Run it in a fresh process with a warm inductor cache.

    python bench/setup_probe.py data.root=PATH/cifar10-jpeg.tgz compile=true
"""
import importlib
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.first_step_probe import Laps  # noqa: E402
from trainer.config import compose_config  # noqa: E402
from trainer.data import cifar  # noqa: E402
from trainer.data.jpeg_files import check_bytes  # noqa: E402
from trainer.dist import Dist  # noqa: E402


def main(overrides: list[str]):
    cfg = compose_config(["+experiment=" + os.environ.get("EXP", "cifar10_speed"), *overrides])
    root, lap = Path(cfg.data.root), Laps()
    torch.empty(1, device="cuda")
    lap("CUDA context")
    members = cifar.read_archive(root, root.read_bytes())
    lap("read_archive")
    lists = {s: cifar.jpeg_list(root, s, members) for s in ("train", "val")}
    lap("jpeg_list, both splits")
    for names, _, _ in lists.values():
        check_bytes(names, [members[n] for n in names])
    lap("check_bytes, 60,000 files")
    import nvidia.dali.fn  # noqa: F401
    import nvidia.dali.plugin.pytorch  # noqa: F401
    lap("import DALI")
    from trainer.data.dali import decode_all
    names = lists["train"][0]
    encoded = [np.frombuffer(members[n], np.uint8) for n in names]
    decode_all(names, encoded, os.cpu_count(), (32, 32), "CIFAR-10's images are 32x32").to("cuda")
    torch.cuda.synchronize()
    lap("decode 50,000 on the host, to the GPU")
    for module in ("triton", "kernels.triton_ops", "torch._dynamo", "torch._inductor.compile_fx"):
        importlib.import_module(module)
        lap(f"import {module}")
    torch.linalg.eigh(torch.eye(27, device="cuda"))
    lap("first eigh on the GPU")
    from trainer.loop import Trainer
    lap("import trainer.loop")
    Trainer(cfg, Path(tempfile.mkdtemp()), Dist())
    lap("Trainer(), its parts logged above")


if __name__ == "__main__":
    main(sys.argv[1:])
