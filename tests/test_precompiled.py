"""compile_cache: the model's forward and backward compiled ahead of time, kept as files
that later runs load instead of compiling."""
import logging

import pytest
import torch
from torch import nn

from trainer import precompiled
from trainer.config import compose_config
from trainer.dist import Dist
from trainer.errors import ConfigError
from trainer.precompiled import Precompiled, aot_compile_available

if not aot_compile_available():
    pytest.skip(f"torch {torch.__version__} has no torch.compile(...).aot_compile", allow_module_level=True)

TINY = ["data.train_size=512", "data.val_size=128", "trainer.batch_size=32", "trainer.epochs=1", "compile=true"]


class Net(nn.Module):  # at module level: a saved artifact names the class it guards on
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


def test_a_new_run_loads_what_the_first_compiled_and_trains_the_same(tmp_path):
    """The first run compiles its training and its (folded) evaluation forward and saves
    both; a second run, as a new process would, loads them, compiles nothing and ends as
    the first and as compile=true without the cache do."""
    from torch._dynamo.utils import counters

    from trainer.loop import Trainer
    runs = []
    for name, cache in (("first", [f"compile_cache={tmp_path / 'cache'}"]), ("second", [f"compile_cache={tmp_path / 'cache'}"]),
                        ("uncached", [])):
        torch._dynamo.reset()
        counters.clear()
        summary = Trainer(compose_config([*TINY, "fold_bn=true", "model=cifar_resnet20_narrow", *cache]), tmp_path / name, Dist()).fit()
        files = sorted((tmp_path / "cache").glob("*.aot"))
        runs.append((summary["train_loss"], summary["val_loss"], summary["val_top1"], len(files), counters["frames"]["ok"]))
    (first, second, uncached) = runs
    assert first[3] == 2 and second[3] == 2  # training and evaluation; the second run added none
    assert second[4] == 0  # Dynamo traced nothing in the second run
    assert first[:3] == second[:3] == pytest.approx(uncached[:3], rel=1e-5)


def test_artifacts_serve_the_calls_their_guards_take_and_compile_the_rest(tmp_path, monkeypatch, caplog):
    net, x = Net(), torch.randn(2, 3, 8, 8)
    expected = net(x)
    first = Precompiled(net, {}, tmp_path)
    assert torch.allclose(first(x), expected, atol=1e-6)
    saved = sorted(tmp_path.glob("*.aot"))
    assert len(saved) == 1
    (tmp_path / saved[0].name.replace("-", "-0", 1)).write_bytes(b"not an artifact")  # read first, sorted
    with caplog.at_level(logging.WARNING, logger="trainer"):
        again = Precompiled(net, {}, tmp_path)
        assert torch.allclose(again(x), expected, atol=1e-6)
    assert "does not load" in caplog.text and len(list(tmp_path.glob("*.aot"))) == 2  # loaded, not compiled
    net.eval()  # another mode: its guards refuse the training artifact
    assert torch.allclose(again(x), net(x), atol=1e-6) and len(list(tmp_path.glob("*.aot"))) == 3
    net.train()
    monkeypatch.setattr(precompiled, "source_digest", lambda: "changed code")  # guards cannot see code
    changed = Precompiled(net, {}, tmp_path)
    assert torch.allclose(changed(x), expected, atol=1e-6) and len(list(tmp_path.glob("*.aot"))) == 4


def test_compile_cache_without_compile_or_on_a_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="compile_cache only applies with compile=true"):
        compose_config([f"compile_cache={tmp_path}"])
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file; give a folder"):
        compose_config(["compile=true", f"compile_cache={tmp_path / 'file'}"])


def test_compile_cache_turns_on_the_switch_that_torch_2_11_leaves_off(tmp_path):
    """torch 2.11 gives torch.compile's result its aot_compile only with Dynamo's
    enable_aot_compile on, which is off there by default; the check and the compile turn it on."""
    with torch._dynamo.config.patch(enable_aot_compile=False):
        compose_config(["compile=true", f"compile_cache={tmp_path}"])
        net, x = Net(), torch.randn(2, 3, 8, 8)
        assert torch.allclose(Precompiled(net, {}, tmp_path)(x), net(x), atol=1e-6)
    assert len(list(tmp_path.glob("*.aot"))) == 1


def test_an_artifact_that_cannot_be_saved_still_serves_the_run(tmp_path, monkeypatch, caplog):
    from torch._dynamo.aot_compile import AOTCompiledFunction

    def refuse(self, path, *args, **kwargs):
        raise OSError("read-only file system")
    monkeypatch.setattr(AOTCompiledFunction, "save_compiled_function", refuse)
    net, x = Net(), torch.randn(2, 3, 8, 8)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert torch.allclose(Precompiled(net, {}, tmp_path)(x), net(x), atol=1e-6)
    assert "could not save" in caplog.text and "read-only file system" in caplog.text
    assert not list(tmp_path.glob("*.aot"))
