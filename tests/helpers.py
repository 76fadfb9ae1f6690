"""Shared builders for tests: a small CNN bound into an arena with its range ops; `python
run.py` in the test's own process; readers of what the trainer prints."""
import io
import logging
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import kernels.reference as reference
from trainer.arena import Arena
from trainer.binding import bind
from trainer.plan import PlanConfig
from trainer.planner import build_plans
from trainer.range_ops import RangeOps
from trainer.schedule import Hyperparameters
from trainer.variants import derive_variants


def small_cnn(layers: int = 2, seed: int = 0, width: int = 8, classes: int = 5) -> nn.Module:
    torch.manual_seed(seed)
    mods, cin = [], 3
    for _ in range(layers):
        mods += [nn.Conv2d(cin, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        cin = width
    return nn.Sequential(*mods, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))


def bound(model: nn.Module, steps: int = 20, batch: int = 4, resolution: int = 8, classes: int = 5,
          kernels=reference, device="cpu", **config):
    """(plans, arena, ops) for `model` bound into a fresh arena on `device`."""
    plans = build_plans(model, PlanConfig(schedule_steps=steps, **config),
                        derive_variants(16 * batch, 4 * batch, batch, batch, resolution), classes)
    arena = Arena(plans.main, device)
    bind(model, plans.tensors["train_base"], arena)
    return plans, arena, RangeOps(plans.main, arena, kernels)


def hyper(lr=0.05, wd=1e-2, momentum=0.9, beta2=0.999, eps=1e-8, eta=0.001) -> Hyperparameters:
    return Hyperparameters(lr, lr, wd, 0.0, momentum, beta2, eps, eta)


def batches(n: int, batch=4, classes=5, seed=1) -> list:
    """n random (8x8 image batch, labels) pairs for small_cnn."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n)]


def arena_step(model, ops, x, y) -> list[torch.Tensor]:
    """One training step through the range ops; returns the gradients it applied, for a
    reference fed the same (gradients depend on the weights, so the update rule is compared)."""
    ops.schedule()
    ops.clear_grads()
    F.cross_entropy(model(x).float(), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    ops.grad_scaling()
    ops.update()
    ops.cast_weights()
    ops.advance()
    return grads


def serve(source, sizes, resolution, channels=3, dtype=torch.float32, mask=False, epoch=0) -> list:
    """One epoch of a Source: (data, label, mask) of each batch of `sizes`, in fresh tensors."""
    source.start_epoch(epoch, resolution)
    out = []
    for n in sizes:
        data = torch.empty(n, resolution, resolution, channels, dtype=dtype)
        label = torch.empty(n, dtype=torch.int32)
        m = torch.empty(n, dtype=torch.int8) if mask else None
        source.fill(data, label, m, None)
        out.append((data, label, m))
    return out


ROOT = Path(__file__).resolve().parent.parent


def run_py(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python run.py ARGS` started in `cwd`, run in this process: the script as __main__,
    its output (C extensions' too) from file descriptors 1 and 2, its exit status, and a
    traceback for what escapes it, as the interpreter would print them. A new process spends
    2 to 3 s of a 2-core machine importing torch, where a plan or a short CPU run itself
    takes 0.3 to 0.8 s; Hydra's sweeps run their jobs one after the other in one process
    too, so a run leaves no state behind for the next. Signals, imports and torchrun need
    processes of their own."""
    argv = [str(ROOT / "run.py"), *args]
    saved_fds = [os.dup(1), os.dup(2)]
    saved = (sys.stdout, sys.stderr, sys.argv, os.getcwd(), dict(os.environ),
             {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)})
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, warnings.catch_warnings():
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout, sys.stderr = (io.TextIOWrapper(open(fd, "wb", closefd=False), write_through=True) for fd in (1, 2))
        # warnings as a new interpreter shows them: on stderr, once a place, deprecations not
        warnings.resetwarnings()
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        for key, value in (env or {}).items():  # None unsets
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        sys.argv = argv
        os.chdir(cwd)
        try:
            runpy.run_path(argv[0], run_name="__main__")
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
        finally:
            from trainer import app
            while app._HELD:  # the run's folder locks, which the kernel lets go as a process ends
                os.close(app._HELD.pop())
            for handler in root.handlers:  # the run's console and run.log
                if handler not in handlers:
                    handler.close()
            root.handlers[:], root.level = handlers, level
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, saved_fd in zip((1, 2), saved_fds):
                os.dup2(saved_fd, fd)
                os.close(saved_fd)
            sys.stdout, sys.stderr, sys.argv, here, environ, signals = saved
            os.chdir(here)
            os.environ.clear()
            os.environ.update(environ)
            for signum, handler in signals.items():
                signal.signal(signum, handler)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, status, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def table_rows(markdown: str) -> dict[str, list[str]]:
    """A markdown table's body rows by their first cell: the other cells, stripped."""
    return {cells[1].strip(): [c.strip() for c in cells[2:-1]]
            for cells in (line.split("|") for line in markdown.splitlines() if line.startswith("| "))}


def profile_share(profile: str) -> float:
    """The share of the measured step that a bench profile's kernels (or operators) add up to."""
    total = next(v for k, v in table_rows(profile).items() if k.startswith("all, against the measured"))
    return float(total[2].rstrip("%")) / 100


def persistent_state(arena: Arena) -> dict:
    """Every persistent byte of an arena by region, as a checkpoint keeps them (copies)."""
    from trainer import checkpoint
    return {r: checkpoint._region_bytes(arena, r).clone() for r in checkpoint.STATE_REGIONS}


def assert_same_state(first: dict, *others: dict):
    """Each persistent_state is the first one, byte for byte."""
    for other in others:
        for region, data in first.items():
            assert torch.equal(other[region], data), region
