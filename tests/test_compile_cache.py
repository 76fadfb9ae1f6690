"""compile_cache: torch.compile's caches carried in a folder, so that a machine that never
compiled the model starts with them warm."""
import logging

import pytest
import torch

from trainer.compile_cache import CompileCache
from trainer.config import compose_config
from trainer.dist import Dist
from trainer.errors import ConfigError

TINY = ["data.train_size=512", "data.val_size=128", "trainer.batch_size=32", "trainer.epochs=1", "compile=true",
        "fold_bn=true", "model=cifar_resnet20_narrow"]


def _run_on_a_new_machine(tmp_path, monkeypatch, name: str, overrides: list[str]):
    """A run in a fresh process's state, with the machine's caches empty."""
    from torch._dynamo.utils import counters

    from trainer.loop import Trainer
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / f"machine_{name}"))
    torch._dynamo.reset()
    counters.clear()
    summary = Trainer(compose_config([*TINY, *overrides]), tmp_path / name, Dist()).fit()
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]
    return (summary["train_loss"], summary["val_loss"], summary["val_top1"]), hits, misses


def test_a_new_machine_with_the_folder_compiles_nothing_and_trains_the_same(tmp_path, monkeypatch):
    """The first run compiles its training step and its (folded) evaluation and saves their
    caches in the folder; a run on another machine loads them, compiles nothing, adds no
    bundle and ends as the first does. Without the folder that machine compiles all again."""
    folder = [f"compile_cache={tmp_path / 'cache'}"]
    first, _, first_misses = _run_on_a_new_machine(tmp_path, monkeypatch, "first", folder)
    saved = sorted((tmp_path / "cache").glob("*.bin"))
    second, hits, misses = _run_on_a_new_machine(tmp_path, monkeypatch, "second", folder)
    assert len(saved) == 1 and first_misses >= 4  # forward and backward of training, and evaluation
    assert misses == 0 and hits == first_misses
    assert sorted((tmp_path / "cache").glob("*.bin")) == saved
    assert second == pytest.approx(first, rel=1e-6)
    _, hits, misses = _run_on_a_new_machine(tmp_path, monkeypatch, "without", [])
    assert hits == 0 and misses == first_misses


def test_evaluation_alone_saves_what_it_compiled(tmp_path, monkeypatch):
    """mode=eval compiles its evaluation after set-up on a CPU; the bundle still has it."""
    from trainer.app import run_eval
    from trainer.loop import Trainer
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "machine"))
    Trainer(compose_config([*TINY, "compile=false"]), tmp_path / "run", Dist()).fit()
    torch._dynamo.reset()
    run_eval(compose_config([*TINY, "mode=eval", f"checkpoint={tmp_path / 'run'}", f"compile_cache={tmp_path / 'cache'}"]),
             tmp_path / "eval")
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 1


def test_a_bundle_that_does_not_load_is_skipped(tmp_path, caplog):
    cache = CompileCache(tmp_path, torch.device("cpu"))
    (tmp_path / f"{cache.prefix}-0.bin").write_bytes(b"not a bundle")
    (tmp_path / "torch0.0-other device-0.bin").write_bytes(b"another torch's: not read")
    with caplog.at_level(logging.WARNING, logger="trainer"):
        cache.load()
    assert caplog.text.count("skipping") == 1 and f"{cache.prefix}-0.bin" in caplog.text


def test_a_folder_that_cannot_be_made_costs_the_bundle_not_the_run(tmp_path, monkeypatch, caplog):
    """Nothing to load there, and the save that fails says so; the compiled model still runs."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "machine"))
    torch._dynamo.reset()
    (tmp_path / "file").write_text("")
    cache = CompileCache(tmp_path / "file" / "cache", torch.device("cpu"))
    cache.load()
    net, x = torch.nn.Linear(4, 2), torch.randn(3, 4)
    assert torch.allclose(torch.compile(net)(x), net(x))  # a compile the machine's caches lacked
    with caplog.at_level(logging.WARNING, logger="trainer"):
        cache.save()
    assert "could not save" in caplog.text and "NotADirectoryError" in caplog.text


def test_compile_cache_without_compile_or_on_a_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="compile_cache only applies with compile=true"):
        compose_config([f"compile_cache={tmp_path}"])
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file; give a folder"):
        compose_config(["compile=true", f"compile_cache={tmp_path / 'file'}"])
