"""The BatchNorm kernels compile for an H200 at the tiles they run with, on any machine:
tests/compile_for_h200.py compiles them ahead of time for sm_90 in a process of its own
(the CPU tests of tests/test_kernels.py run them under Triton's interpreter, which does
not compile them)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed: its kernels cannot be compiled")


def test_each_batch_norm_pass_compiles_for_an_h200_with_its_loads_staged():
    """What `stages` in BnTiles buys (docs/BENCHMARKS.md, session K): each pass's loads go
    through shared memory, as cp.async copies, and a program's buffers fit in the 227 KB of
    shared memory a block may have on an H200 (two programs of a pass share an SM)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_h200.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    passes = json.loads(proc.stdout)
    assert len(passes) == 18
    for name, p in passes.items():
        assert p["staged"] == (p["stages"] > 1), name
        assert 0 < p["shared"] <= 227 * 1024 // 2, name
