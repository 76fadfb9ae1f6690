"""Where our step's peak device memory is set: the plan's arena, the warm-up on the
executor's stream (cuDNN autotuning included), the capture, the replays. Against the
eager loop's peak in `mode=bench`.

    python bench/memory_probe.py model=resnet18_cifar data.resolution=32 amp=true trainer.batch_size=512
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.config import compose_config  # noqa: E402
from trainer.feeder import BUFFERS  # noqa: E402
from trainer.setup import assemble  # noqa: E402


def lap(what: str):
    torch.cuda.synchronize()
    print(f"{what:<36} allocated {torch.cuda.memory_allocated() / 2**30:6.3f} GiB, peak since the last "
          f"{torch.cuda.max_memory_allocated() / 2**30:6.3f} GiB, reserved {torch.cuda.memory_reserved() / 2**30:6.3f}")
    torch.cuda.reset_peak_memory_stats()


def main(overrides: list[str]):
    cfg = compose_config(["mode=bench", *overrides])
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    engine = assemble(cfg, device)
    print(f"arena {engine.plans.main.total_bytes / 2**30:.3f} GiB")
    lap("assemble")
    program = engine.executor.programs[("train_base", BUFFERS[0])]
    stream = engine.executor.stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        program()
    lap("one warm-up step (autotuning)")
    with torch.cuda.stream(stream):
        program()
    lap("a second warm-up step")
    engine.executor.capture([("train_base", b) for b in BUFFERS])
    lap("capture (its own warm-up first)")
    for i in range(5):
        engine.executor.run("train_base", BUFFERS[i % 2])
    lap("five replays")


if __name__ == "__main__":
    main(sys.argv[1:])
