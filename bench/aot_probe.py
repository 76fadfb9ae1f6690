"""The model's forward and backward compiled ahead of time (torch.compile's aot_compile,
experimental), against the compile the trainer does now: how long the artifact takes to
make and how large it is, then, in a fresh process, how long loading it and its first
forward and backward take, against that first call through torch.compile with inductor's
caches warm. The model is built as compile=true builds it and the input is the training
program's (its arena view, `.grad` released as the programs run forward):

    python bench/aot_probe.py make /tmp/r50.aot model=resnet50 data.resolution=224 \\
        data.num_classes=1000 amp=true trainer.batch_size=256
    python bench/aot_probe.py load /tmp/r50.aot ...   # each in a fresh process
    python bench/aot_probe.py warm /tmp/r50.aot ...   # (warm ignores the path)
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.setup_probe import Laps  # noqa: E402
from trainer.config import compile_options, compose_config  # noqa: E402
from trainer.feeder import BUFFERS  # noqa: E402
from trainer.precompiled import compile_ahead  # noqa: E402
from trainer.setup import assemble, compiled, use_device  # noqa: E402

MODES = ("make", "load", "warm")


def main(mode: str, path: str, overrides: list[str]):
    if mode not in MODES:
        sys.exit(f"mode {mode!r}: one of {', '.join(MODES)}")
    cfg = compose_config(["mode=bench", "compile=true", *overrides])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_device(device, cfg)
    lap = Laps(sync=lambda: torch.cuda.synchronize(device) if device.type == "cuda" else None)
    engine = assemble(cfg, device)
    program = engine.programs[("train_base", BUFFERS[0])]
    model, x = engine.model, program.x
    program.handover.release()  # with the arena's .grad views bound, the saved guards do not load
    lap("assemble")
    if mode == "make":
        fn = compile_ahead(model, x, compile_options(cfg))
        lap("aot_compile")
        fn.save_compiled_function(path)
        lap(f"save ({os.path.getsize(path) / 2**20:.1f} MiB)")
    if mode == "load":
        with open(path, "rb") as f:
            fn = torch.compiler.load_compiled_function(f)
        lap("load")
    forward = compiled(model, cfg) if mode == "warm" else lambda x: fn(model, x)
    forward(x).float().sum().backward()
    lap("first forward and backward")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
