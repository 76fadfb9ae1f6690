"""Where our trainer's time to first step goes (mode=bench's "first step s"): the build
(model, plans, arena, binding, programs; the imports it needs are timed first), the
first program call (Dynamo's trace, the compile or the caches' load, cuDNN's
autotuning, inductor's runtime tuning, Triton's loading), the other warm-up calls with
the captures, and one replay. Then dynamo's own timers, inductor's tuning counters and
the functions cProfile saw take the most time. Run it twice on one inductor cache, cold
and then warm; model.cudnn_benchmark=true|false puts cuDNN's autotuning in or out, to
show its share (ResNet-50's config leaves it out). With compile_cache=DIR, the first run
fills the folder and the second, given a copy of it elsewhere, shows a new machine's
first step (section compilecacheprobe):

    python bench/first_step_probe.py model=resnet50 data.resolution=224 data.num_classes=1000 \\
        amp=true trainer.batch_size=256 compile=true
"""
import contextlib
import cProfile
import importlib
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.config import compose_config  # noqa: E402
from trainer.feeder import BUFFERS  # noqa: E402
from trainer.setup import assemble, use_device  # noqa: E402


class Laps:
    """Prints the seconds since the last lap. `sync` runs first: what waits for queued
    device work, for phases that leave some."""

    def __init__(self, sync=lambda: None):
        self.start = self.t = time.perf_counter()
        self.sync = sync

    def __call__(self, what: str):
        self.sync()
        t = time.perf_counter()
        print(f"{what:<44} {t - self.t:7.2f} s", flush=True)
        self.t = t


def main(overrides: list[str]):
    cfg = compose_config(["mode=bench", *overrides])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_device(device, cfg)
    print(f"cudnn.benchmark={torch.backends.cudnn.benchmark}")
    profiler = cProfile.Profile()
    profiler.enable()
    lap = Laps(sync=lambda: torch.cuda.synchronize(device) if device.type == "cuda" else None)
    for module in ("torchvision", "kernels.triton_ops", "torch._inductor.compile_fx"):
        importlib.import_module(module)  # imports assemble would make
        lap(f"import {module}")
    engine = assemble(cfg, device)
    lap("assemble (model, plans, arena, programs)")
    keys = [("train_base", b) for b in BUFFERS]
    stream = engine.executor.stream  # None on a CPU: the calls run there, without graphs
    for key, what in zip(keys, ("first program call", "second program call (other buffer)")):
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            engine.programs[key]()
        lap(what)
    engine.executor.capture(keys)
    lap(f"capture: {engine.executor.warmup} warm-ups, a capture each")
    engine.executor.run(*keys[0])
    lap("one replay")
    profiler.disable()
    print(f"{'in all':<44} {lap.t - lap.start:7.2f} s\n")
    from torch._dynamo.utils import compile_times, counters
    print(compile_times(repr="str", aggregate=True))
    for kind in ("inductor", "aot_autograd"):
        print(f"{kind} counters:", {k: v for k, v in counters[kind].items() if v})
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(45)
        print(out.getvalue())


if __name__ == "__main__":
    main(sys.argv[1:])
