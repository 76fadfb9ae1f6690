"""What DALI's GPU JPEG decoder needs to keep its speed beside a busy GPU: free SMs, or
hardware queues of its own. The matmuls standing in for the step run on all SMs or are
confined to n of them by a CUDA green context (torch.cuda.green_contexts); DALI stays in
the primary context. Printed:
1. one matmul's time, eager and replayed as a CUDA graph, on all SMs and on n;
2. the decoder's images/s alone, beside matmuls on all SMs, and beside matmuls on n SMs.
Run it under several CUDA_DEVICE_MAX_CONNECTIONS (the trainer sets 32 unless it is set):

    python -m trainer.data.make_jpeg_tree /tmp/small --classes 16 --per-class 256 --val-per-class 1
    CUDA_DEVICE_MAX_CONNECTIONS=8 python bench/green_probe.py /tmp/small
"""
import sys
from pathlib import Path

import torch
from torch.cuda.green_contexts import GreenContext

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decoder_probe import BATCH, pipeline, rate  # noqa: E402
from trainer.data.jpeg_files import list_split  # noqa: E402

SMS = (124, 116, 100)


CONTEXTS = []  # a green context is destroyed with its Python object: keep them all


def green_stream(num_sms: int) -> torch.cuda.Stream:
    CONTEXTS.append(GreenContext.create(num_sms=num_sms, device_id=0))
    return CONTEXTS[-1].Stream()


def matmul_ms(stream, graph: bool, a, n: int = 50) -> float:
    with torch.cuda.stream(stream):
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(n):
                    a @ a
            run = g.replay
        else:
            def run():
                for _ in range(n):
                    a @ a
        run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        run()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / n


def main(root: str):
    print(torch.__version__, [m for m in dir(GreenContext) if not m.startswith("_")],
          torch.cuda.get_device_properties(0).multi_processor_count, "SMs", flush=True)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.half)
    streams = {"all": torch.cuda.Stream(), **{n: green_stream(n) for n in SMS}}
    for name, s in streams.items():
        print(f"matmul 8192, {name} SMs: eager {matmul_ms(s, False, a):.3f} ms, graph {matmul_ms(s, True, a):.3f} ms",
              flush=True)
    files, labels, _ = list_split(Path(root) / "train")
    files, labels = files[:16 * BATCH], labels[:16 * BATCH].tolist()
    for variant in ("gpu decoder", "gpu decoder, JPEG engines only"):
        p = pipeline(variant, files, labels)
        p.build()
        for _ in range(8):
            p.run()
        torch.cuda.synchronize()
        row = [f"alone {rate(p):,.0f}"]
        for name, s in streams.items():
            with torch.cuda.stream(s):
                for _ in range(1500):
                    a @ a
            row.append(f"beside matmuls on {name} SMs {rate(p):,.0f}")
            torch.cuda.synchronize()
        print(f"| {variant} | " + " | ".join(row) + " img/s |", flush=True)
        del p


if __name__ == "__main__":
    main(sys.argv[1])
