"""compile=true with compile_cache=DIR: torch.compile's caches kept in a folder that can
go from machine to machine.

Inductor keeps what it compiled (the generated code, its Triton binaries, each kernel's
tuning) and AOTAutograd its traced forward and backward under TORCHINDUCTOR_CACHE_DIR;
Triton keeps the binaries of the trainer's own kernels and the launcher it builds for each
kernel under TRITON_CACHE_DIR. Both default to places on the machine, so a machine that
never compiled the model compiles it cold: ResNet-50's first step takes 62 s on an H200
against 11 s with the caches warm (docs/BENCHMARKS.md). compile_cache=DIR puts both caches
in DIR, so a machine that is given the folder (a copy, or a shared file system) starts
warm. Their entries are keyed by everything they depend on (the graph, the settings,
torch, Triton, the device) and written by atomic renames, so one folder serves several
models, torch versions and GPUs, and ranks and runs may share it.

Triton's keys include the version of the ptxas that assembles a kernel. Inductor points
Triton at the ptxas that torch ships only on its own compile paths (its workers, and its
compiles in the process, as a warm load makes them): before use_torch_ptxas, a cold
run's other compiles (the kernels' tuning, the trainer's kernels) used Triton's ptxas
(CUDA 12.8 with Triton 3.6) and every later process torch's (13.0 with torch
2.11+cu130), so the first warm load, from this folder or from the machine's caches,
built 32 of ResNet-18's kernels again.
"""
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("trainer")


def use_compile_cache(folder: Path):
    """Inductor's and Triton's caches in `folder`, from here on in this process. Set before
    the first compile and the first Triton kernel, and read again by inductor's compile
    workers at every compile."""
    folder = folder.resolve()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    log.info("compile_cache: inductor's and Triton's caches in %s", folder)


def use_torch_ptxas(torch_dir: Path = Path(torch.__file__).parent):
    """Every Triton kernel of this process assembled by the ptxas torch ships, where it ships
    one (torch_dir/bin/ptxas, the one inductor picks), from the first kernel on. A
    TRITON_PTXAS_PATH already set is kept."""
    ptxas = torch_dir / "bin" / "ptxas"
    if "TRITON_PTXAS_PATH" not in os.environ and ptxas.is_file() and os.access(ptxas, os.X_OK):
        os.environ["TRITON_PTXAS_PATH"] = str(ptxas)
