"""Steady training throughput of runs made with trainer.log_every=1: the median images/s
over the last epoch's steps (its first step, which spans the epoch boundary and the
evaluation, left out), and each run's ratio to the first run named; with rank 0's arena
and peak device memory.

    python bench/throughput.py RUN_DIR_ONE_GPU RUN_DIR_TWO_GPUS ...
"""
import json
import statistics
import sys
from pathlib import Path


def steady(run_dir: Path) -> tuple[float, int, dict]:
    """(median images/s, steps it is taken over, summary) of one run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # a resumed run repeats the steps after its checkpoint: a step's later row is the one that counts
    steps = list({r["step"]: r for r in rows if "step" in r}.values())
    # the last epoch's rows but its first, and a resumed attempt's first, which have no rate
    last = [r["images_per_s"] for r in steps if r["epoch"] == steps[-1]["epoch"]][1:]
    last = [rate for rate in last if rate is not None]
    return statistics.median(last), len(last), json.loads((run_dir / "summary.json").read_text())


if __name__ == "__main__":
    base = None
    for name in sys.argv[1:]:
        rate, count, summary = steady(Path(name))
        base, world, peak = base or rate, summary["world_size"], summary["peak_memory_bytes"]
        print(f"{name}: {world} GPU(s), {rate:,.0f} images/s (median of {count} steps), "
              f"{rate / base:.2f}x the first run, {rate / base / world:.1%} per GPU; arena "
              f"{summary['arena_bytes'] / 2**30:.3f} GiB, "
              + (f"peak {peak / 2**30:.3f} GiB a GPU" if peak is not None else "no device peak (a CPU run)"))
