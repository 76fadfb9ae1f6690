"""compile_cache: torch.compile's caches kept in a folder, so that a machine given the
folder starts with them warm."""
import os
import shutil

import pytest
import torch

from tests.helpers import assert_same_state, persistent_state
from trainer.config import compose_config
from trainer.dist import Dist
from trainer.errors import ConfigError

TINY = ["data.train_size=512", "data.val_size=128", "trainer.batch_size=32", "trainer.epochs=1", "compile=true",
        "fold_bn=true", "model=cifar_resnet20_narrow", "model.depth=8", "deterministic=true"]


def _run_on_a_new_machine(tmp_path, monkeypatch, name: str, overrides: list[str], machine: str | None = None):
    """A run in a fresh process's state, on a machine whose own caches start empty (the
    caches of `machine`, where given: the machine of an earlier run). Returns the run's
    results, its hits and misses of the compile caches (a bypass of AOTAutograd's, which
    would trace and partition forward and backward again, counted as a miss), and the
    trainer."""
    from torch._dynamo.utils import counters

    from trainer.loop import Trainer
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / f"machine_{machine or name}"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / f"machine_{machine or name}_triton"))
    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(compose_config([*TINY, *overrides]), tmp_path / name, Dist())
    summary = trainer.fit()
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = (counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"] +
              counters["aot_autograd"]["autograd_cache_bypass"])
    return (summary["train_loss"], summary["val_loss"], summary["val_top1"]), hits, misses, trainer


def test_a_new_machine_with_the_folder_compiles_nothing_and_trains_the_same(tmp_path, monkeypatch, caplog):
    """The first run compiles its training step and its (folded) evaluation into the
    folder, not into the machine's caches, and says so before it starts; a run on another
    machine, given a copy of the folder at another path, compiles nothing and ends as the
    first does (deterministic=true: on a GPU, cuDNN's autotuning could otherwise pick other
    algorithms in each run), though the model's BatchNorms are custom autograd Functions,
    which AOTAutograd's cache refuses by default. Without the folder that machine compiles
    all again."""
    with caplog.at_level("INFO", logger="trainer"):
        first, _, first_misses, _ = _run_on_a_new_machine(tmp_path, monkeypatch, "first",
                                                          [f"compile_cache={tmp_path / 'cache'}"])
    assert f"load it from {(tmp_path / 'cache').resolve()} in seconds" in caplog.text
    assert first_misses >= 4  # forward and backward of training, and evaluation
    assert os.environ["TRITON_CACHE_DIR"] == str((tmp_path / "cache").resolve() / "triton")  # the trainer's kernels too
    assert not (tmp_path / "machine_first").exists()
    shutil.copytree(tmp_path / "cache", tmp_path / "elsewhere" / "cache")
    second, hits, misses, _ = _run_on_a_new_machine(tmp_path, monkeypatch, "second",
                                                    [f"compile_cache={tmp_path / 'elsewhere' / 'cache'}"])
    assert misses == 0 and hits == first_misses
    assert second == pytest.approx(first, rel=1e-6)
    _, hits, misses, _ = _run_on_a_new_machine(tmp_path, monkeypatch, "without", [])
    assert hits == 0 and misses == first_misses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_compiled_run_resumed_from_the_caches_it_filled_ends_as_one_compiled_cold_and_uninterrupted(
        tmp_path, monkeypatch):
    """deterministic=true with compile=true on a GPU: a run that stops after its first epoch
    compiles cold (inductor tunes its kernels by timing them); resumed in a new process on
    the same machine it loads all of that from the machine's caches. It ends with every
    persistent byte of the run that went on uninterrupted on another machine, which compiled
    and tuned on its own: under deterministic mode no tuning may change how a sum is split."""
    two = ["trainer.epochs=2"]
    _, _, cold, straight = _run_on_a_new_machine(tmp_path, monkeypatch, "straight", two)
    _run_on_a_new_machine(tmp_path, monkeypatch, "first", [*two, "trainer.stop_after_epoch=1"])
    _, hits, misses, resumed = _run_on_a_new_machine(tmp_path, monkeypatch, "resumed",
                                                     [*two, f"trainer.resume={tmp_path / 'first'}"], machine="first")
    assert cold >= 4 and misses == 0 and hits == cold
    assert_same_state(persistent_state(resumed.arena), persistent_state(straight.arena))
    assert resumed.history == straight.history


def test_compile_cache_without_compile_or_where_no_folder_can_be_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="compile_cache only applies with compile=true"):
        compose_config([f"compile_cache={tmp_path}"])
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file; give a folder"):
        compose_config(["compile=true", f"compile_cache={tmp_path / 'file'}"])
    with pytest.raises(ConfigError, match="cannot make the folder"):
        compose_config(["compile=true", f"compile_cache={tmp_path / 'file' / 'cache'}"])
    compose_config(["compile=true", f"compile_cache={tmp_path / 'new' / 'cache'}"])
    assert (tmp_path / "new" / "cache").is_dir()
    (tmp_path / "new" / "cache" / "triton").write_text("")  # failed at the first compile, after set-up
    with pytest.raises(ConfigError, match=f"^compile_cache={tmp_path / 'new' / 'cache'} holds a file named triton, "
                                          "where the triton cache goes; move it, or give another folder$"):
        compose_config(["compile=true", f"compile_cache={tmp_path / 'new' / 'cache'}"])


def test_triton_assembles_with_the_ptxas_torch_ships(tmp_path, monkeypatch):
    """Triton keys its cache by the ptxas version: every kernel of a run goes through the one
    inductor's compiles use (torch's, where torch ships one), or a warm load would build
    the cold run's kernels again. A ptxas the user chose stays."""
    from trainer.compile_cache import use_torch_ptxas
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    use_torch_ptxas(tmp_path)
    assert "TRITON_PTXAS_PATH" not in os.environ  # no ptxas in this torch: Triton's own
    ptxas = tmp_path / "bin" / "ptxas"
    ptxas.parent.mkdir()
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    use_torch_ptxas(tmp_path)
    assert os.environ["TRITON_PTXAS_PATH"] == str(ptxas)
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/cuda/bin/ptxas")
    use_torch_ptxas(tmp_path)
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/cuda/bin/ptxas"
