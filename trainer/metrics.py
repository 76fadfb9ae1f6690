"""Run records: metrics.jsonl, the progress line, summary.json and curves.png.

Step metrics arrive as TensorFutures; they are written when ready, in order, so logging
never makes the host wait for the device, except for an epoch's own steps when its record is written."""
import contextlib
import json
import math
import sys
import time
from collections import deque
from pathlib import Path

from trainer.future import TensorFuture
from trainer.errors import WriteError
from trainer.run_dir import RECORDS, writing
from trainer.signals import held


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool = True, log=None, new: bool = False):
        """new: the file must not exist (a new run claims its folder with it, FileExistsError
        if another has); else rows are appended (a resumed run's)."""
        self.enabled, self.log = enabled, log
        self.path = run_dir / RECORDS
        self.file = open(self.path, "xb" if new else "ab", buffering=0) if enabled else None
        self.tty = enabled and sys.stdout.isatty()
        self.pending: deque = deque()
        self.last = None  # (future, images so far, epoch) of the last written step

    def step(self, step: int, epoch: int, variant: str, images: int, results: TensorFuture, lr: TensorFuture):
        """Queue this step's R_RESULT and learning rate; `images` counts since the run began,
        `epoch` from 1, as the epoch's record does."""
        self.pending.append((dict(step=step, epoch=epoch, variant=variant), images, results, lr))
        self.poll()

    def poll(self, wait_through: float = -1):
        """Write the step rows that are ready, in order; those of epochs up to wait_through
        are waited for."""
        while self.pending and (self.pending[0][0]["epoch"] <= wait_through or self.pending[0][2].is_ready()):
            row, images, results, lr = self.pending.popleft()
            loss, top1, top5 = (float(v) for v in results.get())
            row.update(loss=loss, top1=top1, top5=top5, lr=float(lr.get()[0]))
            row["images_per_s"] = self._rate(results, images, row["epoch"])
            self.last = (results, images, row["epoch"])
            self._write(row)

    def _rate(self, results: TensorFuture, images: int, epoch: int) -> float | None:
        """Images a second since the epoch's previous logged step; None for its first, as the
        time since the last epoch's holds its evaluation and checkpoint."""
        if self.last is None or self.last[2] != epoch:
            return None
        prev, prev_images, _ = self.last
        if results.event is not None:
            seconds = prev.event.elapsed_time(results.event) / 1000
        else:
            seconds = results.enqueued_at - prev.enqueued_at
        return round((images - prev_images) / seconds, 1) if seconds > 0 else None

    def _write(self, row: dict):
        if not self.enabled:
            return
        self._append(row)
        rate = f"{row['images_per_s']:,.0f} img/s" if row.get("images_per_s") else ""
        line = (f"epoch {row['epoch']} step {row['step']} {row.get('variant', '')} loss {row['loss']:.4f} "
                f"top1 {row['top1']:.3f} {rate}")
        if self.tty:
            print("\r" + line.ljust(100), end="", flush=True)
        elif self.log is not None:
            self.log.info(line)

    def epoch(self, row: dict):
        """An epoch's train and evaluation sums, as one record, after its step rows. The steps
        of the next epoch, already queued, are not waited for: the device would run dry while
        the host then prepared the epoch after."""
        self.poll(wait_through=row["epoch"])
        if self.tty:
            print()
        self._write_record(row)

    def _write_record(self, row: dict):
        if self.enabled:
            self._append(row)
            if self.log is not None:
                # four decimals for losses and accuracies; a loss scale (2^16 and up) in six digits
                self.log.info(" ".join(f"{k} {v:.4f}" if isinstance(v, float) and abs(v) < 1e4 else
                                       f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))

    def _append(self, row: dict):
        """One line, whole or not at all: where a write fails (a full disk) the file is cut back
        to where it ended, so that a resume's rows follow whole lines."""
        end = self.file.seek(0, 2)
        line = memoryview((to_json(row) + "\n").encode())
        try:
            while line:  # a raw file may take part of it
                line = line[self.file.write(line):]
        except OSError as e:
            with contextlib.suppress(OSError):  # a file system made read-only refuses this too
                self.file.truncate(end)
            raise WriteError(f"cannot write {self.path} ({e.strerror or e})", e.errno) from None

    def close(self):
        self.poll(wait_through=float("inf"))
        if self.file:
            self.file.close()


def to_json(row: dict, **kwargs) -> str:
    """JSON, with a non-finite number (a diverged loss) as null: NaN and Infinity, which
    json.dumps writes by default, are not JSON, and readers refuse the file."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()},
                      **kwargs)


def write_summary(run_dir: Path, summary: dict):
    with writing(run_dir / "summary.json") as f:  # rewritten at each checkpoint
        f.write(to_json(summary, indent=1).encode())


def read_summary(run_dir: Path) -> dict:
    """A run's summary.json; {} where there is none to read (none yet, or damaged)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def plot_curves(run_dir: Path, epochs: list[dict]):
    """Loss and top-1 per epoch, training and evaluation."""
    with held():  # its first import initializes native modules
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    x = [e["epoch"] for e in epochs]
    for ax, key in ((ax_loss, "loss"), (ax_acc, "top1")):
        for split in ("train", "val"):
            ys = [e.get(f"{split}_{key}") for e in epochs]
            if any(y is not None for y in ys):
                ax.plot(x, ys, marker="o", label=split)
        ax.set_xlabel("epoch")
        ax.set_ylabel(key)
        ax.legend()
    fig.tight_layout()
    with writing(run_dir / "curves.png") as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)


class Stopwatch:
    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start
