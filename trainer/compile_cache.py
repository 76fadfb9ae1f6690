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
models, torch versions and GPUs, and ranks and runs may share it. Torch 2.11's first
process to load a cold run's entries builds some Triton kernels again, under new keys
that then stay in the folder: a folder that a cold run and one more run have used takes
a new machine to ResNet-50's first step in 10.9 s, against 22 s after the cold run alone.
"""
import logging
import os
from pathlib import Path

log = logging.getLogger("trainer")


def use_compile_cache(folder: Path):
    """Inductor's and Triton's caches in `folder`, from here on in this process. Set before
    the first compile and the first Triton kernel, and read again by inductor's compile
    workers at every compile."""
    folder = folder.resolve()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    log.info("compile_cache: inductor's and Triton's caches in %s", folder)
