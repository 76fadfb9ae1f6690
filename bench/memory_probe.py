"""Where our step's peak device memory is set: the plan's arena, the warm-up on the
executor's stream (cuDNN's autotuning first, one convolution at a time, then under
compile=true the compile), the capture, the replays; then what was allocated at the peak
moment, largest first, each with the code that allocated it. Against the eager loop's
peak in `mode=bench`.

    python bench/memory_probe.py model=resnet18_cifar data.resolution=32 amp=true trainer.batch_size=512 [compile=true]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.config import compose_config  # noqa: E402
from trainer.executor import tune_convolutions  # noqa: E402
from trainer.feeder import BUFFERS  # noqa: E402
from trainer.setup import assemble, use_device  # noqa: E402


def lap(what: str):
    torch.cuda.synchronize()
    print(f"{what:<36} allocated {torch.cuda.memory_allocated() / 2**30:6.3f} GiB, peak since the last "
          f"{torch.cuda.max_memory_allocated() / 2**30:6.3f} GiB, reserved {torch.cuda.memory_reserved() / 2**30:6.3f}")
    torch.cuda.reset_peak_memory_stats()


def where(frames: list[dict]) -> str:
    """The allocating code: the innermost frame where it lies inside torch (an ATen op,
    inductor's runtime), then the innermost frames outside torch's own package (the
    trainer, the kernels, inductor's generated code)."""
    ours = [f for f in frames if "/site-packages/" not in f["filename"] and "/lib/python" not in f["filename"]]
    shown = (ours or frames)[:3]
    if frames and frames[0] is not shown[0]:
        shown = [frames[0], *shown[:2]]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in shown)


def live_at_peak(trace: list[dict], start_bytes: int, top: int = 15):
    """Replays the allocator's trace: the moment allocated memory was highest, and the
    blocks alive then that the trace saw allocated."""
    live, total, peak, at_peak = {}, start_bytes, start_bytes, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    print(f"\npeak {peak / 2**30:.3f} GiB: {start_bytes / 2**30:.3f} allocated before the trace, then")
    groups: dict[str, list[int]] = {}
    for e in at_peak.values():
        groups.setdefault(where(e["frames"]), []).append(e["size"])
    for site, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(sizes) / 2**20:8.1f} MiB in {len(sizes):3d} blocks  {site}")


def main(overrides: list[str]):
    cfg = compose_config(["mode=bench", *overrides])
    device = torch.device("cuda")
    use_device(device, cfg)
    torch.backends.cudnn.benchmark = True
    engine = assemble(cfg, device)
    print(f"arena {engine.plans.main.total_bytes / 2**30:.3f} GiB")
    lap("assemble")
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    program = engine.executor.programs[("train_base", BUFFERS[0])]
    stream = engine.executor.stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tune_convolutions(program.model, program.x)
    lap("cuDNN's autotuning, conv by conv")
    with torch.cuda.stream(stream):
        program()
    lap("one warm-up step")
    with torch.cuda.stream(stream):
        program()
    lap("a second warm-up step")
    engine.executor.capture([("train_base", b) for b in BUFFERS])
    lap("capture (its own warm-up first)")
    for i in range(5):
        engine.executor.run("train_base", BUFFERS[i % 2])
    lap("five replays")
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    live_at_peak(trace, start)


if __name__ == "__main__":
    main(sys.argv[1:])
