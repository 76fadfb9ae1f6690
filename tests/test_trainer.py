"""The trainer end to end on the CPU: the default run, resume, export, multirun, config
groups and the non-finite-loss paths."""
import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, assert_same_state, persistent_state, profile_share, run_py, table_rows
from tests.test_data_cifar import write_batches
from trainer import checkpoint, loop
from trainer.config import compose_config, recorded
from trainer.dist import Dist
from trainer.errors import CheckpointError, ConfigError, DivergedError, WriteError
from trainer.future import TensorFuture
from trainer.plan import Baseline as B
from trainer.regions import Region as R
from trainer.run_dir import find_checkpoint, saved

CONF = ROOT / "conf"
TINY = ["data.train_size=512", "data.val_size=128", "trainer.batch_size=32"]
SMALL = ["data.train_size=64", "data.val_size=32", "trainer.batch_size=8", "device=cpu"]  # epochs of 8 steps


def config(*overrides):
    return compose_config(overrides)


def arguments(run_dir: Path, *args, multirun=False) -> list[str]:
    """run.py's arguments, with its run (or sweep) directory at run_dir."""
    where = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    return [*(["-m"] if multirun else []), where, *args]


def command(run_dir: Path, *args, multirun=False) -> list[str]:
    """`python run.py ...` as a process of its own: for signals, imports and limits."""
    return [sys.executable, str(ROOT / "run.py"), *arguments(run_dir, *args, multirun=multirun)]


def as_torchrun(monkeypatch, rank: int = 0, world: int = 1, restarts: int = 0):
    """This process's environment as torchrun gives its workers' (its variables count only
    where WORLD_SIZE and MASTER_ADDR say a launcher started the process)."""
    for key, value in (("RANK", rank), ("WORLD_SIZE", world), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", 29500),
                       ("TORCHELASTIC_RESTART_COUNT", restarts)):
        monkeypatch.setenv(key, str(value))


def from_a_terminal():
    """In the child: SIGINT as a terminal's Ctrl-C delivers it. A script's background job
    (`.ci/run &`) starts its children with SIGINT ignored, and Python then never raises
    KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def started(argv: list[str], **kwargs):
    """A run in the background, to interrupt; killed if the test fails before it ends."""
    proc = subprocess.Popen(argv, preexec_fn=from_a_terminal, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def run(run_dir: Path, *args, multirun=False, cwd: Path | None = None, env=None) -> subprocess.CompletedProcess:
    """`python run.py ...` started in cwd (run_dir's parent unless given), run in this
    process (tests/helpers.py's run_py)."""
    return run_py(arguments(run_dir, *args, multirun=multirun), cwd or run_dir.parent, env)


def test_default_run_learns_and_writes_its_records(tmp_path):
    """`python run.py` with no arguments, as a process of its own: the embedded data set, at
    least 90% top-1."""
    out = subprocess.run(command(tmp_path), capture_output=True, text=True, cwd=tmp_path.parent, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["val_top1"] >= 0.90, summary
    for key in ("val_top5", "val_loss", "train_loss", "steps", "epochs", "images_per_s", "wall_s",
                "time_to_first_step_s", "device", "world_size"):
        assert summary[key] is not None, key
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    assert summary["epochs"] == 4 and summary["device"] == device and summary["world_size"] == 1
    # set-up in its parts: the data read beside the model and its plan, then warm-up and capture
    parts = summary["setup_parts_s"]
    assert list(parts) == ["data", "model_and_plan", "warm_up_compile_capture"]
    assert parts["data"] > 0 and parts["model_and_plan"] > 0 and parts["warm_up_compile_capture"] >= 0
    assert max(parts["data"], parts["model_and_plan"]) + parts["warm_up_compile_capture"] <= summary["setup_s"] + 0.005
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert steps and all({"step", "epoch", "variant", "loss", "top1", "top5", "lr", "images_per_s"} <= set(r)
                         for r in steps)
    assert [r["step"] for r in steps] == sorted(r["step"] for r in steps)
    records = [i for i, r in enumerate(rows) if "val_top1" in r]
    assert len(records) == 4
    for n, (begin, end) in enumerate(zip([-1, *records], records), 1):  # step rows number epochs as records do
        assert {r["epoch"] for r in rows[begin + 1:end]} == {rows[end]["epoch"]} == {n}
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan["regions"]) == 68 and plan["fingerprint"]
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "run.log").exists() and list((tmp_path / "checkpoints").glob("epoch_*.pt"))


def train(tmp_path, *overrides):
    from trainer.loop import Trainer
    trainer = Trainer(config(*TINY, *overrides), tmp_path, Dist())
    trainer.fit()
    return trainer


def test_an_epoch_that_skipped_every_update_in_fp16_is_said_and_its_rows_count_them(tmp_path, caplog):
    """A loss scale far above fp16's range overflows every step's gradients and halves once
    a step: the run trained nothing, where it used to end as if it had. Each epoch's row
    counts its skipped updates and gives the loss scale it ended on; an epoch that skipped
    them all is said. At the usual scale the rows count the few skipped ones, unsaid."""
    with caplog.at_level("WARNING", logger="trainer"):
        trainer = train(tmp_path / "high", "trainer.epochs=2", "amp=true", "amp_dtype=fp16", "trainer.grad_scale_init=1e38")
    rows = trainer.history
    assert [r["skipped_steps"] for r in rows] == [16, 16]
    assert rows[1]["loss_scale"] == pytest.approx(1e38 / 2 ** 32, rel=1e-6)
    assert "epoch 2 skipped 16 of its 16 updates: their gradients were not finite in fp16 at every loss scale tried, " \
           "down to 2.33e+28 now" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainer"):
        trainer = train(tmp_path / "usual", "trainer.epochs=1", "amp=true", "amp_dtype=fp16")
    row = trainer.history[0]
    assert row["skipped_steps"] < 16 and row["loss_scale"] == 2.0 ** 16 / 2 ** row["skipped_steps"]
    assert "skipped" not in caplog.text


def test_epochs_between_evaluations_are_recorded_in_order(tmp_path):
    """An epoch without evaluation or checkpoint is read only after the next one is queued:
    every epoch still gets its row, in order, with its own training metrics."""
    trainer = train(tmp_path, "trainer.epochs=3", "trainer.eval_every=5")
    assert [r["epoch"] for r in trainer.history] == [1, 2, 3]
    assert all("train_loss" in r for r in trainer.history)
    assert ["val_top1" in r for r in trainer.history] == [False, False, True]
    assert trainer.history[0]["train_loss"] != trainer.history[1]["train_loss"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if "train_loss" in r] == [1, 2, 3]


def test_resume_equals_uninterrupted_bit_for_bit(tmp_path):
    """deterministic=true: on a GPU too, where cuDNN's autotuned and atomic kernels otherwise
    make two runs of one configuration differ in their last bits."""
    common = ["trainer.epochs=4", "optimizer=adamw", "ema=true", "trainer.label_smoothing=0.1", "deterministic=true"]
    straight = train(tmp_path / "straight", *common)
    train(tmp_path / "first", *common, "trainer.stop_after_epoch=2")
    resumed = train(tmp_path / "second", *common, f"trainer.resume={tmp_path / 'first'}")
    assert_same_state(persistent_state(resumed.arena), persistent_state(straight.arena))
    assert resumed.ops.s[B.STEP].item() == straight.ops.s[B.STEP].item() == 64
    assert resumed.history == straight.history


def test_a_resumed_runs_summary_counts_the_training_of_every_epoch(tmp_path):
    """train_s and images_per_s were the last part's alone: a run stopped after epoch 1 of 3
    and resumed gave epochs 2 and 3's seconds beside "epochs": 3, and the first part's time
    was lost with its summary."""
    train(tmp_path / "first", "trainer.epochs=3", "trainer.stop_after_epoch=1")
    part = json.loads((tmp_path / "first" / "summary.json").read_text())
    resumed = train(tmp_path / "first", "trainer.epochs=3", f"trainer.resume={tmp_path / 'first'}")
    summary = json.loads((tmp_path / "first" / "summary.json").read_text())
    assert (part["epochs"], summary["epochs"], resumed.images) == (1, 3, 2 * 512)
    assert summary["train_s"] == pytest.approx(part["train_s"] + resumed.train_seconds, abs=2e-3)
    assert summary["images_per_s"] == pytest.approx(3 * 512 / summary["train_s"], rel=1e-3)


def test_a_checkpoint_older_than_the_training_time_it_keeps_takes_it_from_its_runs_summary(tmp_path, caplog):
    """A checkpoint written before checkpoints kept the training so far: its run's summary of
    the same step has it; without one, the summary's figures count from the resume, which
    is said."""
    train(tmp_path / "run", "trainer.epochs=3", "trainer.stop_after_epoch=1")
    path = tmp_path / "run" / "checkpoints" / "epoch_0001.pt"
    saved = torch.load(path, weights_only=True)
    del saved["meta"]["trained"]
    torch.save(saved, path)
    part = json.loads((tmp_path / "run" / "summary.json").read_text())
    resumed = train(tmp_path / "run", "trainer.epochs=3", "trainer.stop_after_epoch=2", f"trainer.resume={path}")
    assert resumed.trained_before == {"images": round(part["images_per_s"] * part["train_s"]), "train_s": part["train_s"]}
    (tmp_path / "run" / "summary.json").unlink()
    path = tmp_path / "run" / "checkpoints" / "epoch_0002.pt"
    saved = torch.load(path, weights_only=True)
    del saved["meta"]["trained"]
    torch.save(saved, path)
    with caplog.at_level("WARNING", logger="trainer"):
        resumed = train(tmp_path / "run", "trainer.epochs=3", f"trainer.resume={path}")
    assert resumed.trained_before == {"images": 0, "train_s": 0.0}
    assert f"{path} does not keep the training time before it" in caplog.text


def test_a_resume_by_another_number_of_processes_says_that_the_result_changes(tmp_path, caplog):
    """Resumed by one process where two trained it (the same global batch), a run trained on
    without a word, each BatchNorm normalizing over the whole batch where it had a half."""
    train(tmp_path / "run", "trainer.epochs=2", "trainer.stop_after_epoch=1")
    path = tmp_path / "run" / "checkpoints" / "epoch_0001.pt"
    saved = torch.load(path, weights_only=True)
    assert saved["meta"]["world"] == 1
    saved["meta"]["world"] = 2  # as a job of two ranks saves it
    torch.save(saved, path)
    with caplog.at_level("WARNING", logger="trainer"):
        train(tmp_path / "run", "trainer.epochs=2", f"trainer.resume={path}")
    assert (f"{path} was trained by 2 process(es) and this run has 1: each BatchNorm normalizes over a rank's share "
            "of the batch") in caplog.text


def test_resuming_a_finished_run_says_so_and_reports_its_results(tmp_path, caplog):
    """Resumed with no epoch left (by hand, or by torchrun restarting a job after its last
    checkpoint), a run trains nothing, says why, and its summary is the checkpoint's."""
    from trainer.loop import Trainer
    first = Trainer(config(*TINY, "trainer.epochs=1"), tmp_path / "first", Dist()).fit()
    with caplog.at_level("INFO", logger="trainer"):
        again = Trainer(config(*TINY, "trainer.epochs=1", f"trainer.resume={tmp_path / 'first'}"),
                        tmp_path / "again", Dist()).fit()
    assert "has trained 1 epoch(s), all that trainer.epochs=1 asks for: nothing left to train" in caplog.text
    for key in ("val_top1", "val_loss", "train_loss", "steps", "epochs"):
        assert again[key] == first[key], key


def test_a_resume_that_trains_nothing_leaves_the_runs_records_as_they_were(tmp_path):
    """Resumed in its folder with fewer epochs than it trained, a run trains nothing; its
    plan.json was written anew with the schedule of epochs it never trained."""
    assert run(tmp_path / "run", *TINY, "trainer.epochs=2").returncode == 0
    records = {p: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file() and p.name != "run.log"}
    out = run(tmp_path / "run", *TINY, "trainer.epochs=1", f"trainer.resume={tmp_path / 'run'}")
    assert out.returncode == 0 and "nothing left to train" in out.stdout + out.stderr, out.stdout + out.stderr
    assert {p: p.read_bytes() for p in records} == records


def test_a_resume_that_trains_nothing_writes_the_summary_a_kill_left_behind_its_newest_checkpoint(tmp_path):
    """Killed after its last checkpoint was in place and before its summary was, a run kept
    the epoch before's summary.json and curves, and its resume, with nothing left to train,
    left them so."""
    train(tmp_path, "trainer.epochs=2", "trainer.stop_after_epoch=1")
    behind = (tmp_path / "summary.json").read_bytes()
    train(tmp_path, "trainer.epochs=2", f"trainer.resume={tmp_path}")
    final = json.loads((tmp_path / "summary.json").read_text())
    (tmp_path / "summary.json").write_bytes(behind)  # as the kill left it
    train(tmp_path, "trainer.epochs=2", f"trainer.resume={tmp_path}")
    mended = json.loads((tmp_path / "summary.json").read_text())
    assert (json.loads(behind)["steps"], mended["steps"], mended["val_epoch"]) == (16, 32, 2)
    for key in ("val_top1", "val_loss", "train_loss", "epochs", "train_s", "images_per_s"):
        assert mended[key] == final[key], key


@pytest.mark.parametrize("sent, status, said", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "terminated")], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_names_the_checkpoint_to_continue_from_which_resumes(tmp_path, sent, status, said):
    """SIGINT mid-run, or SIGTERM (a scheduler's preemption): one line instead of a
    traceback, the shell's exit status, and the checkpoint it names is intact: a run
    resumed from it trains on."""
    with started(command(tmp_path / "run", "trainer.epochs=1000"), cwd=tmp_path, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE) as proc:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "run" / "checkpoints").glob("epoch_*.pt")) and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(sent)
        printed = "".join(proc.communicate(timeout=60))
    assert proc.returncode == status, printed
    assert "Traceback" not in printed
    saved = re.search(said + r"; continue from epoch_(\d+)\.pt with trainer.resume=(\S+)", printed)
    assert saved and Path(saved[2]) == tmp_path / "run", printed
    assert "(which takes this run's options from it)" in printed
    epoch = int(saved[1])
    resumed = run(tmp_path / "resumed", f"trainer.resume={saved[2]}", "trainer.epochs=1000",
                  f"trainer.stop_after_epoch={epoch + 1}")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"after epoch {epoch}" in resumed.stdout + resumed.stderr
    assert json.loads((tmp_path / "resumed" / "summary.json").read_text())["epochs"] == epoch + 1


def test_a_resume_stopped_before_its_first_checkpoint_names_its_changed_options_to_continue_with(tmp_path):
    """A resume that raised trainer.epochs and lowered optimizer.lr, interrupted before it saved a checkpoint of its
    own, was told to continue with trainer.resume alone, which takes the options of the run that wrote the newest
    checkpoint: that trained nothing more (its trainer.epochs were done), or at the old learning rate."""
    assert run(tmp_path / "run", "trainer.epochs=1").returncode == 0
    with started(command(tmp_path / "run", f"trainer.resume={tmp_path / 'run'}", "trainer.epochs=1000",
                         "optimizer.lr=0.05"), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        printed = ""
        while "epoch 2 step" not in printed:
            line = proc.stdout.readline()
            assert line, printed
            printed += line
        proc.send_signal(signal.SIGINT)
        printed += proc.communicate(timeout=60)[0]
    said = re.search(r"continue from epoch_0001\.pt with (.*) \(which takes this run's other options from it\)", printed)
    assert said and said[1].split() == [f"trainer.resume={tmp_path / 'run'}", "trainer.epochs=1000", "optimizer.lr=0.05"], \
        printed
    assert run(tmp_path / "run", *said[1].split(), "trainer.stop_after_epoch=2").returncode == 0
    written = torch.load(tmp_path / "run" / "checkpoints" / "epoch_0002.pt", weights_only=True)["meta"]["config"]
    assert (written["trainer.epochs"], written["optimizer.lr"]) == (1000, 0.05)


@pytest.mark.parametrize("sent, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl_c", "sigterm"])
def test_the_signal_again_while_the_run_winds_down_ends_it_at_once_without_tracebacks(tmp_path, sent, status):
    """A user pressing Ctrl-C twice: the second one, sent here every 10 ms until the process
    is gone, broke into the unwinding or into DALI's exit and printed their tracebacks."""
    with started(command(tmp_path / "run", "trainer.epochs=1000"), cwd=tmp_path, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT) as proc:
        printed = ""
        while "epoch 1 step" not in printed:
            line = proc.stdout.readline()
            assert line, printed
            printed += line
        while proc.poll() is None:
            proc.send_signal(sent)
            time.sleep(0.01)
        printed += proc.communicate(timeout=60)[0]
    assert proc.returncode == status, printed
    assert "Traceback" not in printed and "Exception ignored" not in printed, printed


# Ctrl-C as a module loads: one of run.py's imports, then one that Hydra imports as it composes
@pytest.mark.parametrize("module", ["trainer.app", "omegaconf._impl"])
def test_ctrl_c_before_the_run_starts_is_one_line(tmp_path, module):
    press_ctrl_c_on_import = f"""
import runpy, signal, sys
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            signal.raise_signal(signal.SIGINT)
sys.meta_path.insert(0, CtrlC())
sys.argv = {command(tmp_path / "run")[1:]!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    out = subprocess.run([sys.executable, "-c", press_ctrl_c_on_import], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120, preexec_fn=from_a_terminal)
    assert (out.returncode, out.stderr) == (130, "interrupted\n")
    assert not (tmp_path / "run").exists()


def test_a_signal_that_breaks_into_an_extensions_import_ends_the_run_as_that_signal(tmp_path):
    """SIGTERM as matplotlib's C extension loaded (the summary's plot, after the checkpoint)
    became that module's ImportError, caused by the signal's exception: the run ended with
    a traceback and exit 1, not where to continue from and 143."""
    terminated_as_the_plot_imports = f"""
import runpy, sys
from trainer import app, loop
def plot_curves(run_dir, history):
    try:
        raise app.Terminated
    except app.Terminated as e:
        raise ImportError("initialization failed") from e
loop.plot_curves = plot_curves
sys.argv = {command(tmp_path / "run", *TINY, "trainer.epochs=1")[1:]!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    out = subprocess.run([sys.executable, "-c", terminated_as_the_plot_imports], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 143 and "Traceback" not in out.stderr, out.stderr
    assert re.search(r"terminated; continue from epoch_0001\.pt with", out.stdout + out.stderr), out.stdout + out.stderr


def test_only_an_error_a_signal_caused_ends_the_run_as_that_signal():
    """The chain of causes is followed, not the context of an error raised while handling
    one (a failure of its own), and a chain that loops ends."""
    from trainer.app import Terminated, _raised_by_a_signal
    looped, other = ValueError("a"), ValueError("b")
    looped.__cause__, other.__cause__ = other, looped
    assert _raised_by_a_signal(looped) is None
    try:
        try:
            raise Terminated
        except Terminated:
            raise OSError("the disk failed while the run wound down")
    except OSError as e:
        assert e.__context__ is not None and _raised_by_a_signal(e) is None


def test_a_sweep_job_is_shown_with_its_string_values_unescaped_and_its_lists_as_given():
    from trainer.app import _shown
    assert _shown(["trainer.epochs=$\\{trainer.seed\\}", "bench.baselines=[a\\,b,c]", "~ema", "optimizer=sgd"]) == \
        "trainer.epochs=${trainer.seed} bench.baselines=[a\\,b,c] ~ema optimizer=sgd"


def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_keeps_the_earlier_ones(tmp_path, monkeypatch):
    """A failed write (a full disk): the half-written file goes, the message names the
    checkpoint and how to continue, and the earlier checkpoint still resumes."""
    real_save, saves = torch.save, []

    def save_until_the_disk_fills(obj, f):
        saves.append(f)
        if len(saves) == 2:
            f.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, f)
    monkeypatch.setattr(checkpoint.torch, "save", save_until_the_disk_fills)
    folder = tmp_path / "a" / "checkpoints"
    with pytest.raises(WriteError, match=re.escape(f"cannot write {folder / 'epoch_0002.pt'} (No space left on device); "
                                                   f"the earlier checkpoints in {folder} are intact") + "$"):
        train(tmp_path / "a", "trainer.epochs=3")
    assert sorted(p.name for p in folder.iterdir()) == ["epoch_0001.pt"]
    monkeypatch.undo()
    assert train(tmp_path / "b", "trainer.epochs=3", f"trainer.resume={folder}").history[-1]["epoch"] == 3


def test_ctrl_c_as_a_checkpoint_is_written_stops_the_run_and_leaves_no_part_of_it(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) part way through a write: torch's zip writer, closing, raised "unexpected
    pos" over the interruption, and the run ended in that traceback with exit 1 instead of
    saying where to continue from."""
    import io

    from trainer import run_dir

    class Interrupted(io.FileIO):
        writes = 0

        def write(self, data):
            self.writes += 1
            if self.writes == 5:
                super().write(bytes(data)[:len(data) // 2])
                raise KeyboardInterrupt
            return super().write(data)
    monkeypatch.setattr(run_dir, "open", Interrupted, raising=False)
    with pytest.raises(KeyboardInterrupt):
        with run_dir.writing(tmp_path / "epoch_0002.pt") as f:
            torch.save({"weights": torch.zeros(100_000), "moments": torch.ones(1000)}, f)
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_cannot_be_written_for_its_permissions_is_not_called_a_full_disk(tmp_path):
    """The advice after any write that failed was to make room there; with a folder where the
    file goes (an export's model.json), to make it writable."""
    import errno

    from omegaconf import OmegaConf

    from trainer.app import _once_there_is_room
    from trainer.errors import WriteError
    cfg, hydra = OmegaConf.create({"mode": "train"}), OmegaConf.create({"mode": "RUN"})
    then = f", then remove {tmp_path} and run the command again"
    for code, said in ((errno.ENOSPC, "make room there"), (errno.EACCES, "make it writable"),
                       (errno.EROFS, "make it writable"), (errno.EISDIR, "move the folder that stands where it goes")):
        assert _once_there_is_room(WriteError("cannot write", code), cfg, tmp_path, hydra) == f"; {said}{then}"


def files_up_to(nbytes: int):
    """In the child: a file it writes cannot grow past nbytes, so the write fails as on a full
    disk (with EFBIG, "File too large": Python ignores the SIGXFSZ that comes with it)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.parametrize("mode", ["plan", "train"])
def test_a_file_that_cannot_be_written_is_one_message_and_leaves_no_part_of_it(tmp_path, mode):
    """plan.json (27 kB) in mode=plan, the first checkpoint (650 kB) in training, written
    through torch's writer: one line saying what to do, and no half-written file, which
    would make the folder another run's or a checkpoint to resume from."""
    limit, written = (20_000, "plan.json") if mode == "plan" else (100_000, "checkpoints/epoch_0001.pt")
    out = subprocess.run(command(tmp_path / "run", f"mode={mode}", *TINY, "trainer.epochs=1"), capture_output=True,
                         text=True, cwd=tmp_path, timeout=300, preexec_fn=files_up_to(limit))
    said = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in said, said
    then = "run the command again" if mode == "plan" else f"remove {tmp_path / 'run'} and run the command again"
    assert f"[ERROR] - cannot write {tmp_path / 'run' / written} (File too large); make room there, then {then}\n" in said
    assert not [p for p in (tmp_path / "run").rglob("*") if p.name.startswith(written.split("/")[-1])]


def test_a_metrics_row_that_cannot_be_written_leaves_the_rows_before_it_whole(tmp_path):
    """The file is cut back to its last whole row: a resume's rows follow it."""
    from trainer.metrics import MetricsLog
    log = MetricsLog(tmp_path, new=True)
    log.epoch({"epoch": 1, "train_loss": 1.0})
    size = (tmp_path / "metrics.jsonl").stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, hard))  # the row's first 10 bytes are written
    try:
        with pytest.raises(WriteError, match=re.escape(f"cannot write {tmp_path / 'metrics.jsonl'} (File too large)")):
            log.epoch({"epoch": 2, "train_loss": 0.5})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    log.epoch({"epoch": 2, "train_loss": 0.5})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"epoch": 1, "train_loss": 1.0}\n{"epoch": 2, "train_loss": 0.5}\n'


def test_a_metrics_file_on_a_disk_made_read_only_is_one_message(tmp_path):
    """A file system remounted read-only after an error refuses the cut back as well."""
    from trainer.metrics import MetricsLog

    class ReadOnly:
        def seek(self, offset, whence):
            return 0

        def write(self, data):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        truncate = write
    log = MetricsLog(tmp_path, new=True)
    log.file = ReadOnly()
    with pytest.raises(WriteError, match=re.escape(f"cannot write {tmp_path / 'metrics.jsonl'} (Read-only file system)")):
        log.epoch({"epoch": 1, "train_loss": 1.0})


def test_a_log_configuration_of_hydras_own_replaces_the_runs_whole(tmp_path):
    """hydra/job_logging=disabled: no run.log, and no handler left half configured."""
    out = subprocess.run(command(tmp_path / "run", "mode=plan", "hydra/job_logging=disabled"), capture_output=True,
                         text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".hydra", "plan.json"]


def test_a_log_file_that_cannot_be_written_is_said_once_and_the_log_goes_on(capsys):
    """logging prints a traceback for each line its file cannot take; /dev/full takes none."""
    from trainer.app import LogFile
    handler = LogFile("/dev/full")
    logger = logging.getLogger("test_a_log_file_that_cannot_be_written")
    logger.addHandler(handler)
    try:
        for n in range(3):
            logger.warning("line %d", n)
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert capsys.readouterr().err == "warning: cannot write /dev/full (No space left on device): the log goes on on " \
                                      "the console alone\n"


def test_a_second_signal_while_a_checkpoint_is_written_removes_the_part_written(tmp_path):
    """The exit at once skips written_whole's own removal of the part."""
    script = """
import os, signal, sys
from pathlib import Path
from trainer import app
from trainer.run_dir import written_whole
signal.signal(signal.SIGINT, app._exit_now)
with written_whole(Path(sys.argv[1])) as part:
    part.write_bytes(b"half a checkpoint")
    os.kill(os.getpid(), signal.SIGINT)
"""
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "epoch_0001.pt")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 130 and out.stderr == "stopped at once\n", out.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_run_folder_that_cannot_be_written_is_one_message(tmp_path):
    """A run's folder to resume in, on a disk made read-only: Hydra's traceback, as it failed to
    open run.log there."""
    import tempfile

    from trainer.app import _make
    (tmp_path / "run").mkdir(mode=0o555)
    for folder in (tmp_path / "run", Path("/sys/kernel")):  # root writes in any folder of a disk; sysfs refuses it
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            why = e.strerror
            break
    else:
        pytest.skip("this user writes in every folder at hand")
    with pytest.raises(ConfigError, match=f"^cannot write in the run's folder {folder} \\({why}\\); give one that can "
                                          r"be written with hydra.run.dir=...$"):
        _make(str(folder), "hydra.run.dir")


def test_a_run_folder_on_a_full_disk_is_one_message(tmp_path):
    """A full disk still makes the run's folder and empty files in it; Hydra's .hydra/
    records then failed in its traceback. A small tmpfs, filled, in a mount namespace of
    the run's own."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=256k none {disk} && cat /dev/zero 2>/dev/null > {disk}/fill; '
             f'exec "$@"', "sh"]
    if subprocess.run([*mount, "true"], capture_output=True).returncode != 0:
        pytest.skip("this user cannot mount a tmpfs in a namespace of its own (unshare -rm)")
    out = subprocess.run([*mount, *command(disk / "run", "trainer.epochs=1")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert (out.returncode, out.stdout) == (2, ""), out.stdout + out.stderr
    assert out.stderr == (f"cannot write in the run's folder {disk}/run (No space left on device); make room there, "
                          "or give the run another folder with hydra.run.dir=...\n")


def test_a_new_run_in_another_runs_folder_is_refused_and_leaves_it_as_it_was(tmp_path):
    """A reused hydra.run.dir, or two runs started in the same second: the second new run
    must neither overwrite nor prune the first's checkpoints, nor write into its records."""
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=1")
    before = {p: p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"holds another run's checkpoints \(epoch_0001.pt\): continue that run "
                                          r"with trainer.resume="):
        Trainer(config(*TINY, "trainer.epochs=1"), tmp_path / "a", Dist())
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("")  # a run that has saved no checkpoint yet
    with pytest.raises(ConfigError, match="holds another run's results"):
        Trainer(config(*TINY, "trainer.epochs=1"), tmp_path / "b", Dist())
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "curves.png").write_text("a plot of one's own, which the run's would replace")
    with pytest.raises(ConfigError, match=r"holds another run's results \(curves.png\)"):
        Trainer(config(*TINY, "trainer.epochs=1"), tmp_path / "c", Dist())
    assert {p: p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()} == before


def test_resuming_with_epochs_of_another_length_is_refused(tmp_path):
    """Another batch size would restart the schedule's steps at the wrong epoch; fewer or
    more epochs are the schedule's to change."""
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=2")
    for epochs in (1, 3):
        Trainer(config(*TINY, f"trainer.epochs={epochs}", f"trainer.resume={tmp_path / 'a'}"),
                tmp_path / f"more{epochs}", Dist())
    with pytest.raises(ConfigError, match="trained in epochs of 16 steps, and this run's have 8: trainer.batch_size"):
        Trainer(config(*TINY, "trainer.epochs=2", "trainer.batch_size=64", f"trainer.resume={tmp_path / 'a'}"),
                tmp_path / "b", Dist())


def test_a_run_stopped_inside_an_epoch_is_not_trained_on_as_if_it_were_whole(tmp_path):
    """trainer.epochs=1.5 ends 8 steps into epoch 2; asked for more, a resume would skip the
    epoch's other 8 steps: refused. Asked for the same, it has nothing left to train."""
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=1.5")
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["epochs"] == 1.5
    with pytest.raises(ConfigError, match="ends 8 of 16 steps into epoch 2 .*continue from epoch 1's checkpoint"):
        Trainer(config(*TINY, "trainer.epochs=3", f"trainer.resume={tmp_path / 'a'}"), tmp_path / "b", Dist())
    same = Trainer(config(*TINY, "trainer.epochs=1.5", f"trainer.resume={tmp_path / 'a'}"), tmp_path / "c", Dist())
    assert same.fit()["steps"] == 24


def test_a_refused_resume_leaves_its_folder_free_and_a_finished_one_its_summary(tmp_path):
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=1")
    with pytest.raises(CheckpointError, match="does not fit this run"):
        Trainer(config(*TINY, "model=cifar_resnet20", f"trainer.resume={tmp_path / 'a'}"), tmp_path / "b", Dist())
    assert not (tmp_path / "b" / "metrics.jsonl").exists()  # a corrected command may start there
    summary = (tmp_path / "a" / "summary.json").read_text()
    Trainer(config(*TINY, "trainer.epochs=1", f"trainer.resume={tmp_path / 'a'}"), tmp_path / "a", Dist()).fit()
    assert (tmp_path / "a" / "summary.json").read_text() == summary  # its timings, not a run's of nothing


def test_a_resume_told_to_stop_where_it_resumes_is_refused(tmp_path):
    """The first command's trainer.stop_after_epoch given again would train one more epoch
    and stop, saying it stopped where it was asked to."""
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=3", "trainer.stop_after_epoch=2")
    for stop in (1, 2):
        with pytest.raises(ConfigError, match=f"trainer.stop_after_epoch={stop}: .* has trained 2 epoch"):
            Trainer(config(*TINY, "trainer.epochs=3", f"trainer.stop_after_epoch={stop}",
                           f"trainer.resume={tmp_path / 'a'}"), tmp_path / "a", Dist())
    assert Trainer(config(*TINY, "trainer.epochs=3", f"trainer.resume={tmp_path / 'a'}"), tmp_path / "a",
                   Dist()).fit()["epochs"] == 3


def test_a_torchrun_restart_after_the_stop_asked_for_trains_nothing(tmp_path, monkeypatch, caplog):
    """torchrun restarts a job that failed after writing the checkpoint trainer.stop_after_epoch
    asked for (its resume is that checkpoint, its options the same): the job is done, not refused
    on every restart."""
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=3", "trainer.stop_after_epoch=2")
    summary = (tmp_path / "a" / "summary.json").read_text()
    as_torchrun(monkeypatch, restarts=1)
    restart = config(*TINY, "trainer.epochs=3", "trainer.stop_after_epoch=2", f"trainer.resume={tmp_path / 'a'}")
    with caplog.at_level("INFO", logger="trainer"):
        assert Trainer(restart, tmp_path / "a", Dist()).fit()["epochs"] == 2
    assert "torchrun restarted the job after epoch 2's checkpoint, where trainer.stop_after_epoch=2 stops it" \
        in caplog.text
    assert [p.name for p in saved(tmp_path / "a" / "checkpoints")] == ["epoch_0001.pt", "epoch_0002.pt"]
    assert (tmp_path / "a" / "summary.json").read_text() == summary
    with pytest.raises(ConfigError, match="trainer.stop_after_epoch=1: .* has trained 2 epoch"):  # not this stop's
        Trainer(config(*TINY, "trainer.epochs=3", "trainer.stop_after_epoch=1", f"trainer.resume={tmp_path / 'a'}"),
                tmp_path / "a", Dist())


def test_an_interrupted_runs_summary_and_curves_are_of_its_newest_checkpoint(tmp_path, monkeypatch):
    """Written at each checkpoint: a resume stopped part way leaves the records of the
    checkpoint it would go on from, not those of the command before it."""
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=4", "trainer.stop_after_epoch=1")
    curves = (tmp_path / "a" / "curves.png").read_bytes()
    train_epoch = Trainer.train_epoch

    def interrupted_in_epoch_3(self, epoch):
        if epoch == 2:
            raise KeyboardInterrupt
        return train_epoch(self, epoch)
    monkeypatch.setattr(Trainer, "train_epoch", interrupted_in_epoch_3)
    resumed = Trainer(config(*TINY, "trainer.epochs=4", f"trainer.resume={tmp_path / 'a'}"), tmp_path / "a", Dist())
    with pytest.raises(KeyboardInterrupt):
        resumed.fit()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["steps"] == 32
    assert summary["val_top1"] == resumed.history[1]["val_top1"] and len(resumed.history) == 2
    assert (tmp_path / "a" / "curves.png").read_bytes() != curves


def test_a_checkpoints_summary_reports_the_newest_evaluation_and_when_this_process_reached_it(tmp_path):
    """A checkpoint after an epoch that was not evaluated reported null results, and a time to
    accuracy that ran to the end of that checkpoint's write; now the newest evaluation's
    results and epoch, and this process's time to it, null where it has evaluated nothing."""
    run = ["trainer.epochs=6", "trainer.eval_every=3"]

    def summary_after(stop):
        trainer = train(tmp_path, *run, f"trainer.stop_after_epoch={stop}",
                        *([f"trainer.resume={tmp_path}"] if stop > 2 else []))
        return trainer.history, json.loads((tmp_path / "summary.json").read_text())
    history, summary = summary_after(2)
    assert summary["val_epoch"] is summary["val_top1"] is summary["train_and_eval_s"] is None
    history, summary = summary_after(4)
    assert [row["epoch"] for row in history if "val_top1" in row] == [3] and summary["val_epoch"] == 3
    assert summary["val_top1"] == history[2]["val_top1"] and summary["train_loss"] == history[3]["train_loss"]
    assert 0 < summary["train_and_eval_s"] < summary["wall_s"]
    history, summary = summary_after(5)
    assert summary["val_epoch"] == 3 and summary["val_top1"] == history[2]["val_top1"]
    assert summary["train_and_eval_s"] is None and summary["epochs"] == 5


def test_an_interrupted_torchrun_job_is_told_to_continue_under_torchrun_with_its_processes(tmp_path, monkeypatch):
    """A resume in one process of a two-process job's checkpoint is refused (its epochs have
    half the steps), so the advice names the launch as well as the folder."""
    from omegaconf import OmegaConf

    from trainer.app import _where_to_continue
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "epoch_0003.pt").write_bytes(b"")
    cfg = OmegaConf.create({"trainer": {"resume": ""}})
    hydra = OmegaConf.create({"mode": "RUN"})
    assert _where_to_continue(cfg, tmp_path, hydra) == (f"; continue from epoch_0003.pt with trainer.resume={tmp_path} "
                                                 "(which takes this run's options from it)")
    monkeypatch.setenv("WORLD_SIZE", "2")  # a stray one, outside torchrun
    assert _where_to_continue(cfg, tmp_path, hydra).endswith(f"trainer.resume={tmp_path} (which takes this run's options from it)")
    as_torchrun(monkeypatch, world=2)
    assert _where_to_continue(cfg, tmp_path, hydra) == (f"; continue from epoch_0003.pt with trainer.resume={tmp_path}, under "
                                                 "torchrun with 2 processes as this job (which takes this run's "
                                                 "options from it)")


@pytest.mark.parametrize("overrides, said", [
    (["schedule=poly"], r"schedule.warmup_epochs=5 is 80 steps, not fewer than the run's 32 \(trainer.epochs=2\): the "
                        "learning rate climbs through the whole run and never reaches its peak"),
    # rounded to whole steps as the schedule rounds it: 31.84 steps of warm-up are all 32
    (["schedule.warmup_epochs=1.99"], r"schedule.warmup_epochs=1.99 is 32 steps, not fewer than the run's 32"),
    (["schedule.warmup_epochs=1.9"], None),
    # at step 31.84, after the last (31)
    (["schedule=step", "schedule.milestones=[1.99]"], r"schedule.milestones=\[1.99\] fall after the run's end"),
    (["schedule=step", "schedule.milestones=[1.9]"], None),
    (["ema=true", "trainer.ema_every=32"], "trainer.ema_every=32 is not fewer than the run's 32 steps: the average is "
                                           "updated at the first step alone"),
    (["ema=true", "trainer.ema_every=31"], None),
    (["schedule=step"], r"schedule.milestones=\[30.0, 60.0, 80.0\] fall after the run's end \(trainer.epochs=2\): the "
                        "learning rate stays at its peak"),
    (["schedule=step", "schedule.milestones=[1,30]"], None),
    (["trainer.lowres_epochs=2", "trainer.lowres_resolution=12"],
     "trainer.lowres_epochs=2 is not fewer than trainer.epochs=2: the run never trains at data.resolution=16, which it "
     "is evaluated at"),
    (["trainer.first_conv_freeze_epochs=5"], r"trainer.first_conv_freeze_epochs=5 is not fewer than the run's 32 steps "
                                             r"\(trainer.epochs=2\): the first conv never freezes"),
    (["trainer.first_conv_freeze_epochs=1.99"], "first_conv_freeze_epochs=1.99 is not fewer than the run's 32 steps"),
    (["schedule=cosine"], None),
    (["dist.shard_optimizer=true"], r"dist.shard_optimizer=True has no effect: it is read only with several ranks"),
    (["model.pack_relu_masks=false"], "model.pack_relu_masks=False has no effect: it is read only with a ResNet"),
    (["schedule=cosine", "schedule.milestones=[1]"], r"schedule.milestones=\[1.0\] has no effect: it is read only with "
                                                      "schedule=step"),
])
def test_what_is_set_for_a_longer_run_is_said_before_training(tmp_path, caplog, overrides, said):
    """The schedule presets' warm-up and milestones are set for long runs; in a shorter one the
    learning rate never reaches its peak, or never moves from it; low-resolution epochs or a
    freeze as long as the run never end or never begin. An option this configuration does not
    read is said at the same time."""
    from trainer.loop import Trainer
    with caplog.at_level("WARNING", logger="trainer"):
        Trainer(config(*TINY, "trainer.epochs=2", *overrides), tmp_path, Dist())
    assert re.search(said, caplog.text) if said else not caplog.records, caplog.text


def test_an_option_a_resume_or_an_evaluation_gives_without_effect_is_said(tmp_path):
    """ema_decay=0.5 given to a resume or an evaluation of a run without EMA went unsaid: only
    a new run's options were checked. The run's own options are not said again."""
    assert run(tmp_path / "run", *TINY, "trainer.epochs=2", "trainer.stop_after_epoch=1").returncode == 0
    for mode, said in ([[f"trainer.resume={tmp_path / 'run'}"], ": it is read only with ema=true"],
                       [["mode=eval", f"checkpoint={tmp_path / 'run'}"], " with mode=eval: it evaluates"]):
        out = run(tmp_path / mode[0].split("=")[0], *mode, "ema_decay=0.5")
        printed = out.stdout + out.stderr
        assert out.returncode == 0 and printed.count("has no effect") == 1, printed
        assert f"WARNING] - ema_decay=0.5 has no effect{said}" in printed, printed


def test_the_options_only_training_reads_given_to_an_evaluation_or_export_are_said(tmp_path):
    """optimizer.lr=0.5 or optimizer=lars given to mode=eval or mode=export changed nothing
    without a word, as did data.tta=1 and graphs=false given to export, which evaluates nothing
    and runs no step, and trainer.seed, data.seed_offset and trainer.drop_last given to either:
    each is named once, as written, and the evaluation is the run's own."""
    assert run(tmp_path / "run", *TINY, "trainer.epochs=1").returncode == 0
    # nor do the seed and drop_last: the evaluation set's order and views draw nothing from a seed
    given = ["optimizer=lars", "optimizer.lr=0.5", "trainer.epochs=5", "schedule.gamma=0.5", "trainer.seed=3",
             "data.seed_offset=2", "trainer.drop_last=false", "data.tta=1", "graphs=false"]
    for mode, unread in (("eval", given[:-2]), ("export", given)):
        out = run(tmp_path / mode, f"mode={mode}", f"checkpoint={tmp_path / 'run'}", *given)
        printed = out.stdout + out.stderr
        assert out.returncode == 0 and printed.count("has no effect") == len(unread), printed
        for key in unread:
            assert f"WARNING] - {key} has no effect with mode={mode}: it " in printed, printed
    # those evaluation is said not to read change nothing of it
    assert run(tmp_path / "unread", "mode=eval", f"checkpoint={tmp_path / 'run'}", *given[:-2]).returncode == 0
    evaluated, trained = (json.loads((tmp_path / name / "summary.json").read_text()) for name in ("unread", "run"))
    assert (evaluated["val_loss"], evaluated["val_top1"]) == (trained["val_loss"], trained["val_top1"])


SMALL = ["data.train_size=64", "data.val_size=32", "trainer.batch_size=8", "trainer.epochs=1", "device=cpu"]


def test_an_export_says_and_needs_none_of_the_data_and_trainer_options_it_does_not_read(tmp_path):
    """mode=export reads the model's options alone: data=..., data.resolution or trainer.batch_size
    given to it changed nothing without a word, the checkpoint's data.train_size and
    trainer.batch_size were listed as taken, data=cifar10 was refused for its missing data.root
    and data=imagefolder for its 1000 classes, against the checkpoint's 10."""
    assert run(tmp_path / "run", *SMALL).returncode == 0
    plain = run(tmp_path / "plain", "mode=export", f"checkpoint={tmp_path / 'run'}")
    assert plain.returncode == 0 and "as the run that wrote" not in plain.stdout + plain.stderr, plain.stdout
    weights = torch.load(tmp_path / "plain" / "model_state_dict.pt", weights_only=True)
    given = ["data.train_size=128", "data.resolution=24", "trainer.batch_size=4"]
    for data in ("cifar10", "imagefolder"):
        out = run(tmp_path / data, "mode=export", f"checkpoint={tmp_path / 'run'}", f"data={data}", *given)
        printed = out.stdout + out.stderr
        assert out.returncode == 0 and printed.count("has no effect") == 4, printed
        for key in (f"data={data}", *given):
            assert f"WARNING] - {key} has no effect with mode=export: it writes out" in printed, printed
        assert "as the run that wrote" not in printed, printed
        exported = torch.load(tmp_path / data / "model_state_dict.pt", weights_only=True)
        assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)


def test_an_evaluation_of_a_checkpoint_older_than_model_fingerprints_takes_its_optimizer(tmp_path):
    """A checkpoint written before checkpoints kept their model's fingerprint (and their run's
    options) is restored whole, its optimizer's state too: evaluating one of optimizer=lars
    was refused ("region N_FC_WEIGHT holds different tensors") unless optimizer=lars was
    given, which was then said to have no effect. The checkpoint's optimizer is planned."""
    assert run(tmp_path / "run", *SMALL, "optimizer=lars").returncode == 0
    path = find_checkpoint(tmp_path / "run")
    payload = torch.load(path, weights_only=True)
    for key in ("model_fingerprint", "offsets", "region_bytes"):
        del payload[key]
    del payload["meta"]["config"]
    torch.save(payload, path)
    final = json.loads((tmp_path / "run" / "summary.json").read_text())["val_loss"]
    for given in ([], ["optimizer=lars"], ["optimizer=adam"]):
        folder = tmp_path / f"eval_{given[0].partition('=')[2] if given else 'plain'}"
        out = run(folder, "mode=eval", f"checkpoint={tmp_path / 'run'}", *SMALL[:3], *given)
        printed = out.stdout + out.stderr
        assert out.returncode == 0 and printed.count("has no effect with mode=eval") == len(given), printed
        assert json.loads((folder / "summary.json").read_text())["val_loss"] == final


def test_the_options_mode_bench_does_not_read_are_said(tmp_path):
    """mode=bench times steps on random input: trainer.epochs, the data's augmentation and a run's
    checkpoints given to it changed nothing without a word. Each is named once, as written; the
    options of the step it times (ema_decay with ema=true, the optimizer's lr) are not."""
    bench = ["mode=bench", "bench.steps=1", "bench.warmup=1", "bench.baselines=[]", "model=fastnet_tiny", *TINY]
    unread = ["trainer.epochs=3", "data.flip=none", "trainer.seed=3", "trainer.checkpoint_every=2"]
    out = run(tmp_path / "bench", *bench, "ema=true", "ema_decay=0.9", "optimizer.lr=0.5", *unread)
    printed = out.stdout + out.stderr
    assert out.returncode == 0 and printed.count("has no effect") == len(unread), printed
    for option in unread:
        assert f"WARNING] - {option} has no effect with mode=bench: it times training steps on random input" in printed


def test_an_evaluation_by_batches_of_one_image_is_the_runs_own(tmp_path):
    """mode=eval with trainer.batch_size=1, its evaluation batch, was refused for a training batch of
    one image, which leaves a fastnet's BatchNorms one value to normalize over: evaluation runs
    no training step. Its results are those of the run's own evaluation."""
    assert run(tmp_path / "run", *SMALL).returncode == 0
    out = run(tmp_path / "eval", "mode=eval", f"checkpoint={tmp_path / 'run'}", "trainer.batch_size=1")
    assert out.returncode == 0, out.stdout + out.stderr
    evaluated, trained = (json.loads((tmp_path / name / "summary.json").read_text()) for name in ("eval", "run"))
    assert evaluated["val_top1"] == trained["val_top1"]
    assert evaluated["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-5)  # summed in another order


def test_an_evaluation_given_two_checkpoints_is_refused(tmp_path):
    """checkpoint= and trainer.resume= (which mode=eval reads where checkpoint= is not given)
    naming two: the second was ignored without a word, even where it named nothing."""
    assert run(tmp_path / "run", *TINY, "trainer.epochs=1").returncode == 0
    before = sorted(tmp_path.rglob("*"))
    out = run(tmp_path / "eval", "mode=eval", f"checkpoint={tmp_path / 'run'}", f"trainer.resume={tmp_path / 'none'}")
    assert out.returncode == 2 and out.stderr == (f"checkpoint={tmp_path / 'run'} and trainer.resume={tmp_path / 'none'} "
                                                  "name two checkpoints, and mode=eval reads one: give checkpoint= "
                                                  "alone\n"), out.stderr
    assert sorted(tmp_path.rglob("*")) == before
    newest = tmp_path / "run" / "checkpoints" / "epoch_0001.pt"  # the run's folder and its newest file: one
    assert run(tmp_path / "eval", "mode=eval", f"checkpoint={tmp_path / 'run'}", f"trainer.resume={newest}").returncode == 0


def test_an_evaluation_or_export_given_another_model_is_refused_before_its_folder_is_made(tmp_path):
    """model=resnet18 (or ema=true) given for a fastnet's checkpoint was refused once the run
    had started, in a folder left holding only its .hydra/ and run.log."""
    assert run(tmp_path / "run", *TINY, "trainer.epochs=1").returncode == 0
    path = tmp_path / "run" / "checkpoints" / "epoch_0001.pt"
    for mode, given, said in (("eval", "model=resnet18", "model: checkpoint 'fastnet', this run 'resnet18'"),
                              ("export", "ema=true", "ema: checkpoint False, this run True")):
        out = run(tmp_path / mode, f"mode={mode}", f"checkpoint={tmp_path / 'run'}", given)
        assert out.returncode == 2 and out.stderr == (f"checkpoint {path} does not fit this run: {said}; leave those "
                                                      "options out: evaluation and export take them from the "
                                                      "checkpoint\n"), out.stderr
        assert not (tmp_path / mode).exists()


def test_a_model_option_that_changes_the_checkpoints_tensors_is_refused_by_name_before_its_folder_is_made(tmp_path):
    """model.depth=32 given to evaluate, export or resume a ResNet-20's checkpoint was refused
    once the run had started, naming a region ("B_PREV_MEAN holds different tensors"), not
    the option; options that change no tensor (model.cudnn_benchmark) are the command's.
    model=resnet18 with a model.depth it does not read was refused for that depth (not 6n+2).
    data.num_classes=5 was refused as model.num_classes, which follows it, an option not given."""
    assert run(tmp_path / "run", *TINY, "model=cifar_resnet20", "trainer.epochs=1").returncode == 0
    path = tmp_path / "run" / "checkpoints" / "epoch_0001.pt"
    for mode, given, said, advice in (
            ("eval", ["model.depth=32"], "model.depth: checkpoint 20, this run 32", "evaluation and export take"),
            ("eval", ["data.num_classes=5"], "data.num_classes: checkpoint 10, this run 5", "evaluation and export take"),
            ("export", ["model.width=8", "model.cudnn_benchmark=false"], "model.width: checkpoint 16, this run 8",
             "evaluation and export take"),
            ("train", ["trainer.epochs=2", "model.depth=32", "model.width=8"],
             "model.depth: checkpoint 20, this run 32; model.width: checkpoint 16, this run 8", "a resumed run takes"),
            # the checkpoint's model built with its own depth, not one this run's model does not read
            ("train", ["trainer.epochs=2", "model=resnet18", "model.depth=21"],
             "model.name: checkpoint 'cifar_resnet', this run 'resnet18'", "a resumed run takes")):
        read = f"{'trainer.resume' if mode == 'train' else 'checkpoint'}={tmp_path / 'run'}"
        out = run(tmp_path / mode, f"mode={mode}", read, *given)
        assert out.returncode == 2 and out.stderr == (f"checkpoint {path} does not fit this run: {said}; leave those "
                                                      f"options out: {advice} them from the checkpoint\n"), out.stderr
        assert not (tmp_path / mode).exists()
    out = run(tmp_path / "eval", "mode=eval", f"checkpoint={tmp_path / 'run'}", "model.cudnn_benchmark=false",
              "model.pack_relu_masks=false")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_optimizer_chosen_for_mode_bench_is_said_to_have_no_effect(tmp_path):
    """mode=bench times the optimizers bench.optimizers lists: optimizer=lars timed momentum
    without a word."""
    bench = ["mode=bench", "bench.steps=1", "bench.warmup=1", "bench.baselines=[]", "model=fastnet_tiny", *TINY]
    out = run(tmp_path / "lars", *bench, "optimizer=lars")
    assert out.returncode == 0 and ("WARNING] - optimizer=lars has no effect with mode=bench: it times the optimizers "
                                    "bench.optimizers lists (momentum)") in out.stdout + out.stderr, out.stderr
    out = run(tmp_path / "default", *bench)
    assert out.returncode == 0 and "WARNING" not in out.stdout + out.stderr, out.stdout + out.stderr
    # an option of an optimizer it times is read: lars's, where bench.optimizers lists lars
    out = run(tmp_path / "lars_eta", *bench, "bench.optimizers=[lars]", "optimizer.lars_eta=0.01")
    assert out.returncode == 0 and "WARNING" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_the_dist_options_of_a_one_process_job_are_said_unread(monkeypatch):
    """torchrun with one process plans no shards: dist.shard_optimizer=true there went unsaid."""
    from trainer.config import ignored
    as_torchrun(monkeypatch, world=1)
    assert "dist.shard_optimizer=True has no effect" in " ".join(ignored(config("dist.shard_optimizer=true")))
    as_torchrun(monkeypatch, world=2)
    assert not ignored(config("dist.shard_optimizer=true"))


def test_a_resume_on_another_schedule_length_says_where_the_learning_rate_moves(tmp_path, caplog):
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=2", "trainer.stop_after_epoch=1")
    with caplog.at_level("WARNING", logger="trainer"):
        Trainer(config(*TINY, "trainer.epochs=4", f"trainer.resume={tmp_path / 'a'}"), tmp_path / "a", Dist())
    # the cosine over 32 steps is at half its peak after 16; over 64, at 0.854
    assert re.search(r"trained on a schedule of 32 steps and this run's has 64 \(another trainer.epochs\): the "
                     r"learning rate at step 17 is 0.854 of its peak, where it was 0.5", caplog.text), caplog.text


def test_a_resume_on_another_schedule_length_says_where_the_emas_warm_up_moves(tmp_path, caplog):
    """The EMA's decay warms up as (step / the run's steps)^trainer.ema_warmup_power: a finished run made longer
    went on averaging with a quarter of the decay it ended on, the average forgetting fast again, without a word."""
    from trainer.loop import Trainer
    common = ("schedule=constant", "ema=true", "trainer.ema_warmup_power=2")
    train(tmp_path / "a", "trainer.epochs=2", *common)
    with caplog.at_level("WARNING", logger="trainer"):
        Trainer(config(*TINY, "trainer.epochs=4", *common, f"trainer.resume={tmp_path / 'a'}"), tmp_path / "a", Dist())
    assert ("the learning rate at step 33 stays at 1 of its peak; "
            "the EMA's decay, which warms up over the run's steps (trainer.ema_warmup_power=2), is 0.25 of its full "
            "value there, where it was 1") in caplog.text, caplog.text


@pytest.mark.parametrize("schedule", [("schedule=constant",), ("schedule=step", "schedule.milestones=[3]"),
                                      ("schedule.warmup_epochs=2",)], ids=["constant", "step", "in_warm_up"])
def test_a_resume_on_another_schedule_length_says_nothing_where_the_learning_rate_stays(tmp_path, caplog, schedule):
    """A constant rate, a step schedule's milestones (in epochs) and a warm-up still climbing are where they were
    at the resume point: "the learning rate at step 17 is 1 of its peak, where it was 1" said a move there was none."""
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=2", "trainer.stop_after_epoch=1", *schedule)
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainer"):
        Trainer(config(*TINY, "trainer.epochs=4", *schedule, f"trainer.resume={tmp_path / 'a'}"), tmp_path / "a",
                Dist())
    assert "learning rate" not in caplog.text, caplog.text


def test_a_resume_goes_on_in_its_runs_folder_with_its_options_and_keeps_its_first_command_line(tmp_path):
    """Without hydra.run.dir a resumed run continues in the folder of the run it resumes,
    not in a new timestamped one, with the options that run was started with but for those
    its own command line gives; Hydra's record of the first command line stays, and the
    resumed one is written beside it. An older checkpoint of the folder is refused: training
    on from it would write over the newer ones. The machine's own options (data.threads) are
    the resuming machine's: 16 threads taken to a 2-core machine crowded its cores."""
    first = run(tmp_path / "run", *TINY, "optimizer=lars", "optimizer.lr=0.3", "trainer.epochs=3",
                "trainer.stop_after_epoch=2", "data.threads=1")
    assert first.returncode == 0, first.stdout + first.stderr
    hydra = tmp_path / "run" / ".hydra"
    started = (hydra / "overrides.yaml").read_text()
    resume = ["trainer.log_every=7", f"trainer.resume={tmp_path / 'run'}"]
    out = run_py(resume, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "optimizer.name=lars optimizer.lr=0.3" in out.stdout and "trainer.batch_size=32" in out.stdout
    assert "this command changes the options of the run that wrote" in out.stdout and \
        "trainer.log_every=7 (was 20)" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no outputs/DATE/TIME beside it
    assert [p.name for p in saved(tmp_path / "run" / "checkpoints")] == ["epoch_0002.pt", "epoch_0003.pt"]
    options = [checkpoint.read(tmp_path / "run" / "checkpoints" / f"epoch_000{n}.pt")["meta"]["config"] for n in (2, 3)]
    assert options[1] == {**options[0], "trainer.resume": str(tmp_path / "run"), "trainer.stop_after_epoch": 0,
                          "trainer.log_every": 7, "data.threads": 0}
    assert (hydra / "overrides.yaml").read_text() == started
    assert f"trainer.resume={tmp_path / 'run'}" in (hydra / "resumed_1" / "overrides.yaml").read_text()
    older = run_py([*resume[:-1], f"trainer.resume={tmp_path / 'run' / 'checkpoints' / 'epoch_0002.pt'}"], tmp_path)
    assert older.returncode == 2 and "is not its run's newest checkpoint (epoch_0003.pt is)" in older.stderr


def test_a_resume_says_the_options_it_gives_that_only_set_where_training_starts_have_no_effect(tmp_path, monkeypatch):
    """The head's initial weights, the first conv's and the initial loss scale are the checkpoint's on a resume:
    given to it, they were listed among the options the command changes, and nothing said they changed nothing.
    Its checkpoints keep the run's own (they recorded the given ones, as if its weights had started so), and
    trainer.first_conv_init=whiten computes no whitening, which the checkpoint's weights replace."""
    first = run(tmp_path / "run", *SMALL, "amp=true", "trainer.epochs=2", "trainer.stop_after_epoch=1")
    assert first.returncode == 0, first.stdout + first.stderr
    whitened = []
    monkeypatch.setattr(loop, "whiten_first_conv", lambda *args: whitened.append(args))
    out = run_py(["model.head_std=0.5", "trainer.first_conv_init=whiten", "trainer.grad_scale_init=1024",
                  "trainer.log_every=7", f"trainer.resume={tmp_path / 'run'}"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    changes = next(line for line in out.stdout.splitlines() if "this command changes the options" in line)
    assert changes.endswith(": trainer.log_every=7 (was 20)"), changes
    for key, what in (("model.head_std=0.5", "the head's initial weights"),
                      ("trainer.first_conv_init=whiten", "the first conv's initial weights"),
                      ("trainer.grad_scale_init=1024.0", "the loss scale training starts from")):
        assert (f"WARNING] - {key} has no effect: it sets {what}, and {tmp_path / 'run'} holds its run's own; start "
                "a new run to use it") in out.stdout, out.stdout
    assert whitened == []
    options = [checkpoint.read(tmp_path / "run" / "checkpoints" / f"epoch_000{n}.pt")["meta"]["config"] for n in (1, 2)]
    assert [(o["model.head_std"], o["trainer.first_conv_init"], o["trainer.grad_scale_init"]) for o in options] == \
        [(0.0, "default", 65536.0)] * 2


def test_a_resume_of_another_length_says_what_its_run_then_never_reaches(tmp_path):
    """What a run's options set for later than its end is said as it starts (a step milestone after it), and a resume
    that changes trainer.epochs says it for the run's new length: only the first length's was said, when the run
    first started. What the first start said is not said again."""
    step = ("schedule=step", "schedule.milestones=[3]")
    first = run(tmp_path / "a", *SMALL, *step, "trainer.first_conv_freeze_epochs=3", "trainer.epochs=4",
                "trainer.stop_after_epoch=1")
    assert first.returncode == 0 and "WARNING" not in first.stdout, first.stdout + first.stderr
    out = run_py(["trainer.epochs=2", f"trainer.resume={tmp_path / 'a'}"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("WARNING] - schedule.milestones=[3.0] fall after the run's end (trainer.epochs=2): the learning rate stays "
            "at its peak") in out.stdout, out.stdout
    assert ("WARNING] - trainer.first_conv_freeze_epochs=3 is not fewer than the run's 16 steps (trainer.epochs=2): "
            "the first conv never freezes") in out.stdout, out.stdout
    first = run(tmp_path / "b", *SMALL, *step, "trainer.epochs=2", "trainer.stop_after_epoch=1")
    assert "schedule.milestones=[3.0] fall after the run's end (trainer.epochs=2)" in first.stdout, first.stdout
    out = run_py([f"trainer.resume={tmp_path / 'b'}"], tmp_path)
    assert out.returncode == 0 and "WARNING" not in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "sweep"])
def test_a_run_folder_that_cannot_be_made_is_one_message(tmp_path, multirun):
    (tmp_path / "file").write_text("")  # a folder under a file cannot be made
    out = run(tmp_path / "file" / "run", *(["optimizer=sgd,lars"] if multirun else []), multirun=multirun,
              cwd=tmp_path)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (f"cannot make the run's folder {tmp_path / 'file' / 'run'} (Not a directory); "
                                  f"give one that can be written with {key}=...")


@pytest.mark.parametrize("kind", ["run", "sweep"])
def test_runs_started_in_the_same_second_take_folders_of_their_own(tmp_path, kind):
    """Hydra's timestamped folder is the same for runs started in the same second (a script
    starting one per GPU): the later one takes the name with _2, where it wrote its .hydra/
    over the first's and was then refused; a sweep's jobs go there with it."""
    import datetime
    pattern = "outputs/%Y-%m-%d/%H-%M-%S" if kind == "run" else "outputs/multirun/%Y-%m-%d/%H-%M-%S/0"
    now = datetime.datetime.now()
    taken = [tmp_path / (now + datetime.timedelta(seconds=s)).strftime(pattern) for s in range(-2, 120)]
    for folder in taken:  # another run's, in each of the next two minutes' seconds
        folder.mkdir(parents=True)
        (folder / "plan.json").write_text("another run's")
    out = run_py([*(["-m", "optimizer=sgd,lars"] if kind == "sweep" else []), "mode=plan"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert all((folder / "plan.json").read_text() == "another run's" and
               sorted(p.name for p in folder.iterdir()) == ["plan.json"] for folder in taken)
    made = [p for p in tmp_path.glob("outputs/**/*_2") if p.is_dir()]
    assert len(made) == 1 and made[0].parent == (taken[0].parent if kind == "run" else taken[0].parent.parent)
    jobs = [made[0]] if kind == "run" else [made[0] / "0", made[0] / "1"]
    assert all(json.loads((job / "plan.json").read_text())["regions"] and (job / ".hydra").is_dir() for job in jobs)


def test_only_rank_0_checks_the_shared_folder_and_writes_a_modes_results(tmp_path, monkeypatch):
    """The ranks of a torchrun job share one folder: rank 1 checking it after rank 0 wrote
    plan.json there would refuse its own job's results."""
    from hydra import compose, initialize_config_dir

    from trainer.app import RunDirectory, run_plan
    from trainer.config import register
    (tmp_path / "plan.json").write_text("rank 0's")
    register()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", ["mode=plan"], return_hydra_config=True)
    cfg.hydra.overrides.hydra = [f"hydra.run.dir={tmp_path}"]
    cfg.hydra.run.dir = str(tmp_path)
    as_torchrun(monkeypatch, rank=1, world=2)
    RunDirectory().on_run_start(cfg)
    run_plan(config("mode=plan"), tmp_path)
    assert (tmp_path / "plan.json").read_text() == "rank 0's"
    as_torchrun(monkeypatch, rank=0, world=2)
    with pytest.raises(SystemExit):
        RunDirectory().on_run_start(cfg)


def test_records_rewritten_at_each_checkpoint_are_replaced_whole(tmp_path, monkeypatch):
    """A run stopped while it rewrites curves.png (or summary.json) keeps the previous one."""
    from matplotlib.figure import Figure

    from trainer.metrics import plot_curves
    rows = [{"epoch": 1, "train_loss": 2.0, "val_loss": 2.1, "train_top1": 0.2, "val_top1": 0.3}]
    plot_curves(tmp_path, rows)
    before = (tmp_path / "curves.png").read_bytes()

    def stopped_part_way(self, f, **kwargs):
        f.write(b"\x89PNG half")
        raise KeyboardInterrupt
    monkeypatch.setattr(Figure, "savefig", stopped_part_way)
    with pytest.raises(KeyboardInterrupt):
        plot_curves(tmp_path, rows * 2)
    assert (tmp_path / "curves.png").read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"]


def test_a_run_refused_its_folder_leaves_the_other_runs_command_line_there(tmp_path):
    """Refused before Hydra writes .hydra/ into the folder: the other run's command line,
    which a refused checkpoint's message points to, stays its own."""
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "epoch_0003.pt").write_bytes(b"")
    (other / ".hydra").mkdir()
    (other / ".hydra" / "overrides.yaml").write_text("- optimizer=lars\n")
    out = run(other, "optimizer=sgd", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (f"{other} holds another run's checkpoints (epoch_0003.pt): continue that run with "
                                  f"trainer.resume={other}, or give this one a folder of its own (hydra.run.dir=...)")
    assert (other / ".hydra" / "overrides.yaml").read_text() == "- optimizer=lars\n"


@pytest.mark.parametrize("mode", ["eval", "sweep"])
def test_evaluations_and_sweeps_keep_out_of_another_runs_folder(tmp_path, mode):
    other = tmp_path / ("other" if mode == "eval" else "sweep/0")
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "epoch_0001.pt").write_bytes(b"")
    args = ["mode=eval", f"checkpoint={other}"] if mode == "eval" else ["optimizer=sgd,lars"]
    out = run(other if mode == "eval" else other.parent, *args, multirun=mode == "sweep", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        f"{other} holds another run's checkpoints or results: mode=eval would write its own files over them; give "
        "it a folder of its own (hydra.run.dir=...)" if mode == "eval" else
        f"{other.parent} holds another sweep's jobs (0/ has its checkpoints or results): give this sweep a folder "
        "of its own (hydra.sweep.dir=...); a sweep goes on in its folder only with the command line it was started "
        "with, but for trainer.stop_after_epoch and the machine's options (data.threads, data.decode_cache, "
        "compile_cache, dist.timeout_s)")
    assert list(other.iterdir()) == [other / "checkpoints"]  # nothing written beside them


@pytest.mark.parametrize("first, then", [("eval", "eval"), ("export", "export"), ("export", "train"),
                                         ("plan", "eval")])
def test_a_run_keeps_out_of_a_folder_with_another_runs_results(tmp_path, first, then):
    """An evaluation's summary.json, an export's weights, a plan: a second run given the same
    folder would write its own over them (another checkpoint's weights, without a word)."""
    train(tmp_path / "run", "trainer.epochs=1")
    mode = {"eval": ["mode=eval", f"checkpoint={tmp_path / 'run'}"], "plan": ["mode=plan"],
            "export": ["mode=export", f"checkpoint={tmp_path / 'run'}"], "train": [*TINY, "trainer.epochs=1"]}
    assert run(tmp_path / "out", *mode[first]).returncode == 0
    kept = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()}
    out = run(tmp_path / "out", *mode[then])
    assert out.returncode == 2 and f"{tmp_path / 'out'} holds another run's" in out.stderr, out.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()} == kept


def test_whose_a_run_folder_is(tmp_path, monkeypatch):
    """A run continues in its own folder, resumed from it or restarted by torchrun's agent
    after it wrote there; any other training run is refused the folder, a torchrun job
    given another job's folder again (--rdzv_id, hydra.run.dir) after a restart too."""
    from trainer.run_dir import other_run, restart_checkpoint
    mine, fresh = tmp_path / "mine", tmp_path / "fresh"
    (mine / "checkpoints").mkdir(parents=True)
    fresh.mkdir()
    assert other_run(fresh, "") is None and other_run(fresh, str(mine)) is None
    (mine / "metrics.jsonl").write_text("")
    assert "holds another run's results" in other_run(mine, "")
    (mine / "checkpoints" / "epoch_0001.pt").write_bytes(b"")
    for resume in (mine, mine / "checkpoints", mine / "checkpoints" / "epoch_0001.pt"):
        assert other_run(mine, str(resume)) is None
    (fresh / "metrics.jsonl").write_text("")
    assert "holds another run's results" in other_run(fresh, str(mine))  # resumed, but into a third run's folder
    assert restart_checkpoint(mine) == ""  # not restarted
    # restarted by an agent that does not count it: its workers were well, another node's failed
    as_torchrun(monkeypatch, restarts=0)
    assert restart_checkpoint(mine) == str(mine)  # written after this process's parent started
    for old in (mine / "checkpoints" / "epoch_0001.pt", fresh / "metrics.jsonl"):
        os.utime(old, (0, 0))  # written before it: another job's
    assert restart_checkpoint(mine) == "" and "holds another run's checkpoints" in other_run(mine, "")
    assert "holds another run's results" in other_run(fresh, "")
    (fresh / "metrics.jsonl").touch()  # this job's records, before its first checkpoint
    assert other_run(fresh, "") is None


def test_checkpoints_are_kept_and_found_by_epoch_past_epoch_9999_and_a_users_copies_left_alone(tmp_path):
    """A copy kept beside them (epoch_0003_good.pt, epoch_best.pt) is not the newest
    checkpoint, which a resume would go on from, nor one to prune."""
    for name in ("9998", "9999", "10000", "10001", "10001_good", "best"):
        (tmp_path / f"epoch_{name}.pt").write_bytes(b"")
    (tmp_path / "epoch_10002.pt.4242.part").write_bytes(b"")
    checkpoint.prune(tmp_path, 2)
    assert [p.name for p in saved(tmp_path)] == ["epoch_10000.pt", "epoch_10001.pt"]
    assert not list(tmp_path.glob("*.part"))  # a write killed part way (SIGKILL) left it
    assert find_checkpoint(tmp_path).name == "epoch_10001.pt"
    assert (tmp_path / "epoch_10001_good.pt").exists() and (tmp_path / "epoch_best.pt").exists()


def test_checkpoint_from_another_model_is_refused(tmp_path):
    train(tmp_path / "a", "trainer.epochs=1")
    with pytest.raises(CheckpointError, match="model: checkpoint 'fastnet', this run 'cifar_resnet'; leave those "
                                              "options out: a resumed run takes them from the checkpoint"):
        train(tmp_path / "b", "trainer.epochs=1", "model=cifar_resnet20", f"trainer.resume={tmp_path / 'a'}")
    with pytest.raises(CheckpointError, match="optimizer"):
        train(tmp_path / "c", "trainer.epochs=1", "optimizer=lars", f"trainer.resume={tmp_path / 'a'}")


def test_a_checkpoint_whose_layout_fits_but_whose_optimizer_or_half_type_differs_is_refused(tmp_path):
    """Nesterov's and momentum's state, fp16's and bf16's compute weights lie alike in the
    arena, and only a layout that differed was refused: a resume or an evaluation with
    amp_dtype=fp16 read bf16's half weights as fp16 (evaluated at chance), and a resume with
    optimizer=momentum trained on with nesterov's state, without a word."""
    from trainer.loop import Trainer
    bf16 = ["amp=true", "amp_dtype=bf16"]
    train(tmp_path / "a", "trainer.epochs=1", *bf16)
    resume = f"trainer.resume={tmp_path / 'a'}"
    with pytest.raises(CheckpointError, match="optimizer: checkpoint 'nesterov', this run 'momentum'; leave those "
                                              "options out: a resumed run takes them"):
        Trainer(config(*TINY, "trainer.epochs=2", *bf16, "optimizer=momentum", resume), tmp_path / "b", Dist())
    with pytest.raises(CheckpointError, match="amp_dtype: checkpoint 'bf16', this run 'fp16'"):
        Trainer(config(*TINY, "trainer.epochs=2", "amp=true", "amp_dtype=fp16", resume), tmp_path / "c", Dist())
    with pytest.raises(CheckpointError, match="amp_dtype: checkpoint 'bf16', this run 'fp16'; leave those options out: "
                                              "evaluation and export take them"):
        Trainer(config(*TINY, "mode=eval", "amp=true", "amp_dtype=fp16", resume), tmp_path / "d", Dist(),
                evaluate_only=True)
    # another optimizer's checkpoint still evaluates: its model is the same, also from a checkpoint
    # written before they kept the model's fingerprint, which compared the optimizer too
    Trainer(config(*TINY, "mode=eval", *bf16, "optimizer=momentum", resume), tmp_path / "e", Dist(), evaluate_only=True)
    path = find_checkpoint(tmp_path / "a")
    payload = torch.load(path, weights_only=True)
    del payload["model_fingerprint"]
    torch.save(payload, path)
    Trainer(config(*TINY, "mode=eval", *bf16, "optimizer=momentum", resume), tmp_path / "f", Dist(), evaluate_only=True)
    # without AMP, amp_dtype is read by nothing: not compared
    train(tmp_path / "fp32", "trainer.epochs=1")
    Trainer(config(*TINY, "mode=eval", "amp_dtype=bf16", f"trainer.resume={tmp_path / 'fp32'}"), tmp_path / "g", Dist(),
            evaluate_only=True)


def test_a_metrics_file_that_cannot_be_made_is_one_line_naming_it(tmp_path):
    """A link to nowhere in metrics.jsonl's place said "None"; a folder made read-only after
    it was checked ended in a traceback."""
    from trainer.loop import Trainer
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").symlink_to(tmp_path / "nowhere")
    with pytest.raises(WriteError, match=r"^cannot write .*metrics.jsonl \(File exists\)$"):
        Trainer(config(*TINY, "trainer.epochs=1"), tmp_path / "a", Dist())


def test_a_checkpoint_refuses_class_folders_other_than_those_it_was_trained_on(tmp_path):
    """Label k is the k-th class folder by name: with one renamed, the same count of classes
    passed every check, and evaluation (at 0% top-1) or training went on with each class's
    images under another's label."""
    from trainer.data.make_jpeg_tree import main as make_jpeg_tree
    from trainer.loop import Trainer
    make_jpeg_tree([str(tmp_path / "data"), "--classes", "3", "--per-class", "4", "--val-per-class", "2",
                    "--size", "24x20", "--jobs", "1"])
    data = ["data=imagefolder", "data.num_classes=3", "data.resolution=16", "trainer.batch_size=4",
            f"data.root={tmp_path / 'data'}"]
    Trainer(config(*data, "trainer.epochs=1"), tmp_path / "run", Dist()).fit()
    resume = f"trainer.resume={tmp_path / 'run'}"
    Trainer(config(*data, "mode=eval", resume), tmp_path / "eval", Dist(), evaluate_only=True)  # the same folders
    for split in ("train", "val"):
        (tmp_path / "data" / split / "class_000").rename(tmp_path / "data" / split / "zzz")
    for overrides in (["trainer.epochs=2"], ["mode=eval"]):
        with pytest.raises(ConfigError, match=r"was trained on other class folders than .*data's \(label 0: 'class_000' "
                                              r"there, 'class_001' here; label 1: 'class_001' there, 'class_002' here; "
                                              r"label 2: 'class_002' there, 'zzz' here\): its labels would name other"):
            Trainer(config(*data, *overrides, resume), tmp_path / "run", Dist(), evaluate_only=overrides == ["mode=eval"])


def test_a_checkpoint_saved_after_another_epoch_than_its_name_says_is_refused(tmp_path):
    """Another run's checkpoint put in place of this run's newest (or one renamed) was taken:
    the resume trained that run's model in this folder, wrote over the file and pruned this
    run's own checkpoints by their names. A folder where the newest checkpoint would be is
    named too; an evaluation read it as a run's folder ("no checkpoints in .../epoch_0003.pt")."""
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=2")
    folder = tmp_path / "a" / "checkpoints"
    (folder / "epoch_0002.pt").rename(folder / "epoch_0005.pt")
    for overrides in (["trainer.epochs=6"], ["mode=eval"]):
        with pytest.raises(CheckpointError, match=r"epoch_0005.pt was saved after epoch 2, not 5 as its name says: "
                                                  r"renamed, or another run's put in its place; move it out of "):
            Trainer(config(*TINY, *overrides, f"trainer.resume={tmp_path / 'a'}"), tmp_path / "a", Dist(),
                    evaluate_only=overrides == ["mode=eval"])
    assert sorted(p.name for p in folder.iterdir()) == ["epoch_0001.pt", "epoch_0005.pt"]
    (folder / "epoch_0005.pt").unlink()
    (folder / "epoch_0003.pt").mkdir()
    with pytest.raises(CheckpointError, match=r"epoch_0003.pt is a folder, not a checkpoint: move it out of "):
        find_checkpoint(tmp_path / "a")


@pytest.mark.parametrize("damage", ["truncated", "objects beside tensors", "not a zip archive", "no regions",
                                    "a region cut short", "bytes overwritten", "a record changed"])
@pytest.mark.parametrize("reader", ["resume", "eval"])
def test_a_damaged_checkpoint_is_refused_in_one_line_with_its_path(tmp_path, damage, reader):
    """One line naming the file and the checkpoint before it, to go on from; none of
    torch.load's advice to its own callers (weights_only=False would run whatever the file
    holds), nor a KeyError or a size mismatch from a file that loads but lacks parts. Bytes
    overwritten inside a part are found by its CRC-32, and in the records of the run (its
    options, the offsets of its tensors) by the zip's: they would load, and evaluate or train
    on wrong weights or options."""
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=2")
    path = find_checkpoint(tmp_path / "a")
    saved = torch.load(path, weights_only=True)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "objects beside tensors":  # torch.save's archive, of what a tensors-only load refuses
        torch.save({"run_dir": tmp_path}, path)
    elif damage == "not a zip archive":
        path.write_text("a text file")
    elif damage == "no regions":
        torch.save({k: v for k, v in saved.items() if k != "regions"}, path)
    elif damage == "a region cut short":
        torch.save({**saved, "regions": {k: v[:10] for k, v in saved["regions"].items()}}, path)
    elif damage == "a record changed":  # the run's learning rate in the pickle, which still loads: 16 times it
        key = data.index(b"optimizer.lr")
        value = data.index(struct.pack(">d", saved["meta"]["config"]["optimizer.lr"]), key)
        assert value - key < 24
        path.write_bytes(data[:value] + struct.pack(">d", 16 * saved["meta"]["config"]["optimizer.lr"]) + data[value + 8:])
    else:  # the archive's records are stored, not compressed: the region's bytes are in the file as they are
        path.write_bytes(data[:len(data) // 3] + bytes(len(data) // 6) + data[len(data) // 3 + len(data) // 6:])
    with pytest.raises(CheckpointError, match=f"{path} is damaged .*: move it out of {path.parent} to go on from the "
                                              "checkpoint before it, epoch_0001.pt$") as refused:
        Trainer(config(*TINY, "trainer.epochs=2", f"trainer.resume={tmp_path / 'a'}"), tmp_path / "b", Dist(),
                evaluate_only=reader == "eval")
    message = str(refused.value)
    assert "\n" not in message and "weights_only" not in message and "please" not in message, message


def test_a_file_torch_saved_elsewhere_is_refused_naming_what_to_give(tmp_path):
    torch.save({"weights": torch.zeros(3)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'model.pt'} is not a checkpoint written by this trainer: "
                                              "give one of a run's checkpoints/epoch_N.pt, or its folder$"):
        checkpoint.read(tmp_path / "model.pt")


def test_a_runs_only_checkpoint_damaged_is_refused_with_a_way_on(tmp_path):
    """Not "use another checkpoint" alone, where the folder holds none, and a new run in that
    folder is refused as the folder of a run to continue."""
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=1")
    path = find_checkpoint(tmp_path / "a")
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=f"^{path} is damaged .*, and {path.parent} holds no checkpoint before it: "
                                              "use another checkpoint, or start the run again in a folder of its own$"):
        Trainer(config(*TINY, f"trainer.resume={tmp_path / 'a'}"), tmp_path / "b", Dist())


def test_export_loads_into_torchvision(tmp_path):
    import torchvision
    trained = train(tmp_path / "run", "model=resnet18", "trainer.epochs=1", "ema=true")
    out = run(tmp_path / "export", "mode=export", "model=resnet18", "ema=true", *TINY,
              f"checkpoint={tmp_path / 'run'}")
    assert out.returncode == 0, out.stdout + out.stderr
    state = torch.load(tmp_path / "export" / "model_state_dict.pt", weights_only=True)
    reference = torchvision.models.resnet18(num_classes=10)
    reference.load_state_dict(state, strict=True)
    reference.eval()
    x = torch.randn(4, 3, 16, 16, device=trained.arena.device)
    reference.to(x.device)
    trained.ops.sema_switch()  # evaluation's view: EMA weights and B_PREV statistics
    trained.ops.bn_stats_to_prev()
    from trainer.binding import use_statistics
    model = trained.model.eval()
    use_statistics(model, trained.plans.tensors["train_base"], trained.arena, "prev")
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # fp32 on a GPU too
        torch.testing.assert_close(reference(x), model(x.to(memory_format=torch.channels_last)))


def test_export_of_an_epoch_that_was_not_evaluated_has_its_statistics(tmp_path):
    """Without EMA the exported BN statistics are the training's (B_NEXT), also where the
    checkpoint's epoch was not evaluated: not older ones, nor the initial zeros and ones.
    Beside them, model.json keeps the checkpoint's model options, which no tensor holds (a
    fast net's logit_scale): rebuilt from the group's defaults, its logits were 28 times off."""
    trained = train(tmp_path / "run", "trainer.epochs=2", "trainer.eval_every=5", "trainer.stop_after_epoch=1",
                    "model.logit_scale=0.25")
    out = run(tmp_path / "export", "mode=export", *TINY, f"checkpoint={tmp_path / 'run'}")
    assert out.returncode == 0, out.stdout + out.stderr
    kept = json.loads((tmp_path / "export" / "model.json").read_text())
    assert kept["model"] == dataclasses.asdict(trained.cfg.model) and kept["model"]["logit_scale"] == 0.25
    state = torch.load(tmp_path / "export" / "model_state_dict.pt", weights_only=True)
    tensors = trained.plans.tensors["train_base"]
    for name, s in tensors.bn.items():
        prefix = f"{name}." if name else ""
        assert torch.equal(state[prefix + "running_mean"], trained.arena[s.next_mean].cpu()), name
        assert torch.equal(state[prefix + "running_var"], trained.arena[s.next_var].cpu()), name


def test_an_export_that_found_the_disk_full_after_its_first_file_runs_again_once_there_is_room(tmp_path, monkeypatch):
    """The disk filling after the export's first file: the message said to run the command again
    once there was room, and the command was then refused, the weights written first making the
    folder another run's results."""
    import io

    from trainer import run_dir
    assert run(tmp_path / "run", *TINY, "trainer.epochs=1").returncode == 0
    opened = []

    class FullAfterOne(io.FileIO):
        def __init__(self, *args):
            super().__init__(*args)
            opened.append(self.name)

        def write(self, data):
            if len(opened) > 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)
    monkeypatch.setattr(run_dir, "open", FullAfterOne, raising=False)
    export = ["mode=export", f"checkpoint={tmp_path / 'run'}"]
    out = run(tmp_path / "export", *export)
    assert out.returncode == 2 and len(opened) == 2, out.stdout + out.stderr
    assert "(No space left on device); make room there, then run the command again\n" in out.stdout + out.stderr
    monkeypatch.undo()
    out = run(tmp_path / "export", *export)
    assert out.returncode == 0, out.stdout + out.stderr
    assert torch.load(tmp_path / "export" / "model_state_dict.pt", weights_only=True)
    assert json.loads((tmp_path / "export" / "model.json").read_text())["model"]["name"] == "fastnet"


def test_multirun_sweeps_two_jobs(tmp_path):
    """Each job's results are in its line of the sweep's jobs.jsonl too, where the jobs compare:
    its summary.json (its line held only its overrides)."""
    out = run(tmp_path, "optimizer=sgd,lars", "trainer.epochs=1", *TINY, multirun=True)
    assert out.returncode == 0, out.stdout + out.stderr
    summaries = [json.loads((tmp_path / job / "summary.json").read_text()) for job in "01"]
    assert all(summary["steps"] == 16 for summary in summaries)
    jobs = [json.loads(line) for line in (tmp_path / "jobs.jsonl").read_text().splitlines()]
    assert [(job["job"], job["failed"], job["summary"]) for job in jobs] == [(0, None, summaries[0]),
                                                                             (1, None, summaries[1])]


def test_a_sweep_job_that_fails_is_named_at_the_end_and_the_jobs_after_it_run(tmp_path):
    """A learning rate that diverges fails its job alone; the sweep's exit says which, with its
    overrides as given (the sweeper escapes an interpolation's braces)."""
    out = run(tmp_path, "optimizer.lr=1e9,0.1", "trainer.epochs=1", "trainer.seed=${data.num_classes}", *TINY,
              multirun=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert out.stderr.startswith("1 of the sweep's 2 jobs failed")
    assert re.search(r"\njob 0 \(optimizer.lr=\S+ trainer.epochs=1 trainer.seed=\$\{data.num_classes\} .*\): "
                     r"the epoch's training loss, .* training "
                     r"diverged and stopped", out.stderr), out.stderr
    assert not (tmp_path / "0" / "summary.json").exists()
    assert json.loads((tmp_path / "1" / "summary.json").read_text())["steps"] == 16
    assert [json.loads(line)["summary"] is None for line in (tmp_path / "jobs.jsonl").read_text().splitlines()] == \
        [True, False]
    # Run again in its folder, the failed job, with nothing to go on from, stands failed and the
    # others go on (here: the finished one trains nothing), where its records refused the sweep.
    finished, records = (tmp_path / "1" / "summary.json").read_bytes(), (tmp_path / "0" / "metrics.jsonl").read_bytes()
    again = run(tmp_path, "optimizer.lr=1e9,0.1", "trainer.epochs=1", "trainer.seed=${data.num_classes}", *TINY,
                multirun=True)
    assert again.returncode == 2 and again.stderr.startswith("1 of the sweep's 2 jobs failed"), again.stderr
    assert re.search(r"\njob 0 \(.*\): the epoch's training loss, .* diverged and stopped.* \(in the sweep's earlier "
                     rf"attempt; to start this job anew, remove {re.escape(str(tmp_path / '0'))} and run the sweep "
                     r"again\)\n$", again.stderr), again.stderr
    assert (tmp_path / "1" / "summary.json").read_bytes() == finished
    assert (tmp_path / "0" / "metrics.jsonl").read_bytes() == records
    shutil.rmtree(tmp_path / "0")  # as that says: the job runs anew (and diverges anew)
    anew = run(tmp_path, "optimizer.lr=1e9,0.1", "trainer.epochs=1", "trainer.seed=${data.num_classes}", *TINY,
               multirun=True)
    assert anew.returncode == 2 and re.search(r"\njob 0 \(.*\): the epoch's training loss, .* diverged and stopped",
                                              anew.stderr) and "earlier attempt" not in anew.stderr, anew.stderr
    assert (tmp_path / "0" / "metrics.jsonl").exists()


def test_a_sweep_whose_record_of_its_jobs_cannot_be_written_still_names_the_one_that_failed(tmp_path, monkeypatch):
    """The sweep reads its jobs' ends from its folder's jobs.jsonl (trainer/app.py's JOBS); a
    line that cannot be written (here a folder that is not there, as a full disk refuses
    it) is one warning, and the sweep still ends naming the job that failed, with exit 2,
    where Hydra's warning for the callback's error had it end 0."""
    from trainer import app
    monkeypatch.setattr(app, "JOBS", "gone/jobs.jsonl")
    out = run(tmp_path, "optimizer.lr=1e9,0.1", "trainer.epochs=1", *TINY, multirun=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout + out.stderr
    for job in (0, 1):
        assert (f"warning: cannot write {tmp_path / 'gone' / 'jobs.jsonl'} (No such file or directory): the sweep's "
                f"end counts job {job} only where it ran in the sweep's own process\n") in out.stderr, out.stderr
    assert "1 of the sweep's 2 jobs failed" in out.stderr and "\njob 0 (optimizer.lr=" in out.stderr, out.stderr
    assert "UserWarning" not in out.stderr


def test_a_sweep_with_a_bad_value_in_a_late_job_runs_no_job(tmp_path):
    """Each job's values are checked before the first job trains, not when its turn comes."""
    sweep = tmp_path / "sweep"
    out = run(sweep, "optimizer=sgd,lars", "trainer.batch_size=32,0", "trainer.epochs=1", *TINY[:2], multirun=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("sweep job 1 (optimizer=sgd trainer.batch_size=0 trainer.epochs=1 data.train_size=512 "
                                  "data.val_size=128): trainer.batch_size=0 must be positive; no job has run")
    assert not sweep.exists()


@pytest.mark.parametrize("late, said", [
    (["trainer.batch_size=32,1024"], "trainer.batch_size=1024 is larger than the 512 training examples per rank"),
    (["trainer.lowres_epochs=1", "trainer.lowres_resolution=16,8"], "8x8 images are too small for model=fastnet"),
    (["trainer.first_conv_freeze_epochs=0.5", "trainer.stem_norm_freeze_epochs=0.5", "model.stem_norm=bias,none"],
     "cannot freeze the stem's norm: the model has no BatchNorm right after its first conv"),
    (["kernels=torch,triton"], "kernels=triton: Triton kernels need a CUDA device (this run uses cpu)"),
    (["data.crop_padding=2,16"], "data.crop_padding=16 is not smaller than the images (16x16)")],
    ids=["batch", "resolution", "freeze", "kernels", "crop_padding"])
def test_a_sweep_whose_late_job_its_set_up_would_refuse_runs_no_job(tmp_path, monkeypatch, late, said):
    """What the set-up refuses beyond the values' own checks (the data's size, the model's,
    a freeze, the kernels) stopped a sweep only once the jobs before had trained."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # with which Triton's kernels run on a CPU: the kernel tests'
    sweep = tmp_path / "sweep"
    out = run(sweep, "trainer.epochs=2", "device=cpu", *late, *TINY[:2], multirun=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("sweep job 1 (") and said in out.stderr and out.stderr.endswith("; no job has run\n")
    assert not sweep.exists()


def test_a_sweep_whose_late_job_pads_cifar10s_crops_as_wide_as_its_images_runs_no_job(tmp_path):
    """data=cifar10's padding is checked against its 32x32 images in the data's set-up, which
    stopped the sweep only once job 0 had trained."""
    sweep = tmp_path / "sweep"
    out = run(sweep, "data=cifar10", f"data.root={write_batches(tmp_path / 'cifar')}", "data.crop_padding=2,40",
              "data.train_size=40", "data.val_size=12", "trainer.batch_size=8", "trainer.epochs=1", "device=cpu",
              multirun=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("sweep job 1 (") and out.stderr.endswith(
        "data.crop_padding=40 is not smaller than the images (32x32), which training crops pad by reflecting them; "
        "set data.crop_padding to at most 31; no job has run\n"), out.stderr
    assert not sweep.exists()


@pytest.mark.parametrize("args, said", [
    (["-m", "hydra.sweep.dir=sweep", "optimizer=sgd,adamm"],
     "optimizer=sgd,adamm: conf/optimizer/ has no adamm.yaml; choose one of adam, adamw, lars, momentum, muon, nesterov, "
     "sgd (did you mean optimizer=adam?)\n"),
    (["-m", "hydra.sweep.dir=sweep", "+trainer.epochs=1,2"],
     "sweep job 0 (+trainer.epochs=1): Could not append to config. An item is already at 'trainer.epochs'."),
    (["hydra.run.dir=run", "trainer.resume=none"], "no checkpoint at TMP/none: give a checkpoint file, or a run directory"),
    (["hydra.run.dir=run", "mode=eval", "checkpoint=none"], "no checkpoint at TMP/none: give a checkpoint file"),
    (["hydra.run.dir="], "hydra.run.dir is empty: give the run a folder (hydra.run.dir=...)"),
    (["-m", "hydra.sweep.dir=", "mode=plan", "trainer.seed=1,2"],
     "hydra.sweep.dir is empty: give the run a folder (hydra.sweep.dir=...)"),
    (["hydra.run.dir=run", "trainer.epochs=-1"], "trainer.epochs=-1.0 must be positive\n"),
    (["hydra.run.dir=run", "trainer.seed=1,2"], "trainer.seed=1,2 sweeps over values, which only a sweep runs: add -m "
                                               "(--multirun) for a job each\n"),
    (["hydra.run.dir=run", "schedule.milestones=1,2"], "schedule.milestones=1,2 sweeps over values, which only a sweep "
                                                      "runs: add -m (--multirun) for a job each, or give a list in "
                                                      "brackets: schedule.milestones='[...]'\n"),
    (["hydra.run.dir=run", "data=imagefolder", "data.root=/data/set,v2"],
     "data.root=/data/set,v2 sweeps over values, which only a sweep runs: add -m (--multirun) for a job each, or quote "
     "a path that holds a comma: data.root='/data/set,v2' (inside the shell's own quotes)\n"),
    (["hydra.run.dir=run", "schedule=step", "schedule.milestones=[1,[2]]"],
     "schedule.milestones=[1.0, [2]]: each is a number of epochs\n"),
], ids=["a sweep's misspelled option", "a sweep's job Hydra refuses", "resume", "eval", "empty run folder",
        "empty sweep folder", "a value the checks refuse", "a sweep without -m", "a list's sweep without -m",
        "a path with a comma", "a list in a list"])
def test_a_command_that_cannot_start_says_why_and_leaves_no_folder(tmp_path, args, said):
    """Before Hydra makes the run's folder (an empty run folder is the current one) or writes
    a sweep's multirun.yaml, and without a warning from Hydra's callback machinery."""
    out = run_py(args, tmp_path)
    assert out.returncode == 2 and out.stderr.startswith(said.replace("TMP", str(tmp_path))), out.stderr
    assert list(tmp_path.iterdir()) == []


def test_another_file_or_a_folder_of_runs_for_a_checkpoint_names_what_to_give(tmp_path):
    """A run's plan.json given to resume from was "not its run's newest checkpoint", its
    summary.json to evaluate "damaged, and no checkpoint before it: start the run again";
    a sweep's folder had no word on its jobs' folders."""
    run_dir = tmp_path / "sweep" / "0"
    assert run(run_dir, *TINY, "trainer.epochs=1", cwd=tmp_path).returncode == 0
    for args, said in [
        ([f"trainer.resume={run_dir / 'plan.json'}"], f"{run_dir / 'plan.json'} is not a checkpoint written by this "
                                                      f"trainer: give one of a run's checkpoints/epoch_N.pt, or its "
                                                      f"folder ({run_dir})"),
        (["mode=eval", f"checkpoint={run_dir / 'summary.json'}"], f"{run_dir / 'summary.json'} is not a checkpoint"),
        ([f"trainer.resume={run_dir.parent}"], f"no checkpoints (epoch_N.pt) in {run_dir.parent}: give one of the runs "
                                               f"in it ({run_dir})")]:
        before = sorted(tmp_path.rglob("*"))
        out = run(tmp_path / "other", *args)
        assert out.returncode == 2 and out.stderr.startswith(said + ("\n" if "resume" in args[0] else "")), out.stderr
        assert sorted(tmp_path.rglob("*")) == before


def test_a_sweep_named_by_job_id_checks_every_job_first(tmp_path):
    """hydra.sweep.subdir=${hydra.job.id}: the job's folder resolves as Hydra's launcher sets it."""
    out = run(tmp_path, "mode=plan", "optimizer.lr=0.1,-1", "hydra.sweep.subdir=${hydra.job.id}", multirun=True)
    assert out.returncode == 2 and out.stderr.strip().endswith("must not be negative; no job has run"), out.stderr
    assert not (tmp_path / "0").exists()
    out = run(tmp_path, "mode=plan", "optimizer.lr=0.1,0.2", "hydra.sweep.subdir=${hydra.job.id}", multirun=True)
    assert out.returncode == 0 and (tmp_path / "1" / "plan.json").exists(), out.stderr


def test_a_sweep_counts_a_job_that_crashed_and_goes_on(tmp_path, capsys):
    """A job that fails with any error returns it (main), and the sweep ends naming it; the
    return value of a job Hydra marked failed is not read (it raises its error again). The
    jobs' ends are counted through the sweep's folder: a launcher that runs each job in a
    process of its own (joblib, submitit) calls on_job_end there, not in the sweep's
    process, whose count stayed empty, so its sweep ended with exit 0."""
    from hydra.core.utils import JobReturn, JobStatus
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from trainer.app import JobFailed, RunDirectory
    config = OmegaConf.create({"hydra": {"mode": RunMode.MULTIRUN, "job": {"num": 0}, "sweep": {"dir": str(tmp_path)}}})
    crashed = JobReturn(overrides=["trainer.batch_size=4096"], status=JobStatus.COMPLETED)
    crashed.return_value = JobFailed("OutOfMemoryError: CUDA out of memory")
    RunDirectory().on_job_end(config, crashed)  # in the first job's process
    failed = JobReturn(overrides=["x=1"], status=JobStatus.FAILED, _return_value=RuntimeError("raised again if read"))
    config.hydra.job.num = 1
    RunDirectory().on_job_end(config, failed)  # in the second's
    with pytest.raises(SystemExit) as ended:
        RunDirectory().on_multirun_end(config)  # in the sweep's
    said = capsys.readouterr().err.splitlines()
    assert ended.value.code == 2 and said[0].startswith("1 of the sweep's 2 jobs failed") and said[1:] == [
        "job 0 (trainer.batch_size=4096): OutOfMemoryError: CUDA out of memory"]


def test_paths_given_with_interpolations_are_left_to_resolve():
    """The run-folder callback runs before Hydra's resolvers can: ${hydra:runtime.cwd} is
    left as it is (expanding it failed the callback, which then skipped the folder checks)."""
    from omegaconf import OmegaConf

    from trainer.config import expand_paths
    cfg = OmegaConf.create({"data": {"root": "${hydra:runtime.cwd}/data", "decode_cache": "~/cache"},
                            "compile_cache": "", "checkpoint": "", "trainer": {"resume": "~/run"}, "bench": {"out": ""}})
    expand_paths(cfg)
    assert OmegaConf.is_interpolation(cfg.data, "root")
    assert (cfg.data.decode_cache, cfg.trainer.resume) == (os.path.expanduser("~/cache"), os.path.expanduser("~/run"))


def test_a_sweep_whose_jobs_share_a_folder_runs_no_job(tmp_path):
    """hydra.sweep.subdir without the job's number: the second job would be refused there
    only after Hydra had written its command line over the first's."""
    out = run(tmp_path, "optimizer.lr=0.1,0.2", "hydra.sweep.subdir=${optimizer.name}", *TINY, multirun=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith(f"sweep jobs 0 and 1 would both run in {tmp_path / 'nesterov'}: give each "
                                         "job a folder of its own with hydra.sweep.subdir"), out.stderr
    assert not (tmp_path / "nesterov").exists()


@pytest.mark.parametrize("group", sorted(p.name for p in CONF.iterdir() if p.is_dir()))
def test_every_config_group_option_composes(group):
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        override = f"+{group}={option}" if group == "experiment" else f"{group}={option}"
        reads_files = group == "experiment" or (group == "data" and option != "synthetic")
        cfg = config(override, *(["data.root=/data"] if reads_files else []))
        assert cfg.mode in ("train", "plan", "eval", "export", "bench")


def test_a_data_error_from_the_loading_thread_is_one_message(tmp_path):
    """The data loads in a thread beside the plan: its error still ends the run with one line."""
    damaged = tmp_path / "cifar.tgz"
    damaged.write_bytes(b"not an archive " * 100)
    out = run(tmp_path / "run", "+experiment=cifar10_speed", f"data.root={damaged}")  # whitening waits for the data
    output = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in output
    assert sum(f"cannot read the archive {damaged}" in line for line in output.splitlines()) == 1, output


@pytest.mark.parametrize("amp", ["amp=false", "amp=true"])
def test_nan_loss_stops_and_keeps_the_last_checkpoint(tmp_path, amp):
    """Under AMP too: a loss scale mends overflowing gradients, never a non-finite forward."""
    # the learning rate becomes infinite after the first epoch: the weights and the loss blow up
    explode = ["schedule=step", "schedule.milestones=[1]", "schedule.gamma=inf", "trainer.epochs=3"]
    out = run(tmp_path, *TINY, *explode, amp)
    assert out.returncode != 0
    assert "NaN or infinite" in out.stdout + out.stderr and "Traceback" not in out.stderr
    assert f"The checkpoints saved before are intact (the newest: {tmp_path / 'checkpoints' / 'epoch_0001.pt'})" \
        in out.stdout + out.stderr
    saved = checkpoint.read(tmp_path / "checkpoints")
    assert saved["meta"]["epoch"] == 1
    for name, data in saved["regions"].items():
        if name.startswith("W_"):
            assert torch.isfinite(data.view(torch.float32)).all(), name


def test_the_images_counted_at_each_step_include_a_short_last_batch(tmp_path, monkeypatch):
    """With drop_last off the epoch ends in a shorter batch; the count behind each step's
    images/s is the images trained so far, not the steps times the last batch's size."""
    from trainer.metrics import MetricsLog
    counted = {}
    log_step = MetricsLog.step
    monkeypatch.setattr(MetricsLog, "step", lambda self, step, epoch, variant, images, *rest: (
        counted.__setitem__(step, images), log_step(self, step, epoch, variant, images, *rest)))
    t = train(tmp_path, "data.train_size=500", "trainer.drop_last=false", "trainer.log_every=1",
              "trainer.epochs=2")
    assert t.per_epoch == 16  # 15 batches of 32 and one of 20
    assert counted == {e * 16 + i: e * 500 + min(i * 32, 500) for e in range(2) for i in range(1, 17)}
    # a rate within its epoch: the time since the last epoch's last step holds its evaluation and checkpoint
    rates = {r["step"]: r["images_per_s"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if "step" in r}
    assert [step for step, rate in rates.items() if rate is None] == [1, 17] and len(rates) == 32


def test_a_finite_but_diverged_loss_stops_the_run_before_its_checkpoint(tmp_path):
    """A learning rate of 1e9 trains on at losses of 1e24, never NaN, at chance accuracy."""
    with pytest.raises(DivergedError, match=r"the epoch's training loss, .*e\+2\d, is over 1000 times a uniform "
                                            r"guess's \(2.3\): training diverged and stopped. No checkpoint was saved before it"):
        train(tmp_path, "optimizer.lr=1e9", "trainer.epochs=2")
    assert not list((tmp_path / "checkpoints").glob("*"))


def test_a_nan_late_in_the_last_epoch_stops_the_run_while_the_device_runs_behind(tmp_path, monkeypatch):
    """On a GPU the host runs ahead, so the flag's copy queued at a logged step is still in
    flight at the next ones; the check at the epoch's end must still see the last step's."""
    monkeypatch.setattr(TensorFuture, "is_ready", lambda self: False)
    # the learning rate becomes infinite half-way through the second and last epoch
    with pytest.raises(DivergedError):
        train(tmp_path, "trainer.log_every=4", "schedule=step", "schedule.milestones=[1.5]", "schedule.gamma=inf",
              "trainer.epochs=2")


def test_a_non_finite_validation_loss_is_named_and_training_goes_on(tmp_path, caplog):
    """Statistics that make evaluation overflow (here a negative running variance) give one
    warning that says what happened and what to change; the evaluation's row still comes."""
    trained = train(tmp_path, "trainer.epochs=1")
    trained.arena.flat(R.B_NEXT_VAR).fill_(-1.0)
    with caplog.at_level("WARNING", logger="trainer"):
        row = trained.evaluate()
    assert math.isnan(row["val_loss"]) and 0 <= row["val_top1"] <= 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "validation loss is NaN" in warnings[0] and "optimizer.lr" in warnings[0]


def test_folded_batchnorm_evaluates_like_batchnorm(tmp_path):
    """fold_bn: evaluation through W_EQ (x * scale + bias) gives the unfolded result."""
    common = ["model=cifar_resnet20_narrow", "trainer.epochs=1", "ema=true", "deterministic=true"]
    plain = train(tmp_path / "plain", *common).history[-1]
    folded_run = train(tmp_path / "folded", *common, "fold_bn=true")
    folded = folded_run.history[-1]
    assert folded_run.arena.flat(R.W_EQ_SCALE).abs().sum() > 0
    assert folded["train_loss"] == plain["train_loss"], "folding changes evaluation only"
    assert folded["val_top1"] == pytest.approx(plain["val_top1"], abs=1 / 128)
    assert folded["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-4)


def test_eval_mode_reproduces_the_final_evaluation(tmp_path):
    trained = train(tmp_path / "run", "trainer.epochs=1")
    out = run(tmp_path / "eval", "mode=eval", *TINY, f"checkpoint={tmp_path / 'run'}")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "eval" / "summary.json").read_text())
    final = trained.history[-1]
    assert not (tmp_path / "eval" / "metrics.jsonl").exists()  # no records of training: it trains nothing
    assert f"evaluating {tmp_path / 'run' / 'checkpoints' / 'epoch_0001.pt'}, saved after epoch 1" in out.stdout
    assert result["val_top1"] == final["val_top1"] and result["val_loss"] == pytest.approx(final["val_loss"])


def test_a_path_given_with_a_tilde_is_under_the_home_folder(tmp_path):
    """Hydra's grammar takes a ~ in quotes (checkpoint='~/run'), and the shell leaves it as it
    is: the trainer expands it, in the run's folder too, where Hydra made a folder named ~
    in the current one. Unquoted, it is one line saying to quote it."""
    train(tmp_path / "run", "trainer.epochs=1")
    home = {"HOME": str(tmp_path)}
    out = run_py(["mode=eval", *TINY, "checkpoint='~/run'", "hydra.run.dir='~/eval'"], tmp_path / "run", home)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["checkpoint"] == \
        str(tmp_path / "run" / "checkpoints" / "epoch_0001.pt")
    assert not (tmp_path / "run" / "~").exists()
    out = run_py(["mode=plan", "hydra.run.dir=~/plan"], tmp_path, home)
    assert (out.returncode, out.stderr) == (2, "hydra.run.dir=~/plan: Hydra's grammar cannot read this override; a "
                                               "value with other characters than ASCII letters, digits and / . - _ goes "
                                               "in quotes: hydra.run.dir='~/plan' (inside the shell's own quotes)\n")


def test_relative_paths_are_kept_absolute_so_a_resume_elsewhere_reads_the_same_files(tmp_path, monkeypatch):
    """A checkpoint keeps its run's options; a relative data.root taken by a resume or an
    evaluation started in another folder would name another data set there, or none."""
    monkeypatch.chdir(tmp_path)
    cfg = config(*TINY, "trainer.resume=runs/a")
    assert cfg.trainer.resume == str(tmp_path / "runs" / "a") and cfg.compile_cache == ""
    (tmp_path / "data").mkdir()
    assert config("data=imagefolder", "data.root=data/").data.root == str(tmp_path / "data")
    # an older checkpoint's relative paths are read from here, as they were, and compare equal to the same given
    older = {"data.root": "data", "data.decode_cache": "", "optimizer.lr": 0.1}
    assert recorded(older) == {"data.root": str(tmp_path / "data"), "data.decode_cache": "", "optimizer.lr": 0.1}


def test_eval_and_export_take_the_model_options_of_the_run_that_wrote_the_checkpoint(tmp_path):
    """Only the checkpoint on the command line: its model, resolution, amp, ema and fold_bn
    options come with it, and the data it was evaluated on; a model given there instead is
    the one built, and refused by name."""
    trained = train(tmp_path / "run", "model=cifar_resnet20_narrow", "amp=true", "amp_dtype=bf16", "ema=true",
                    "fold_bn=true", "data.resolution=24", "trainer.epochs=1")
    out = run(tmp_path / "eval", "mode=eval", f"checkpoint={tmp_path / 'run'}")
    assert out.returncode == 0, out.stdout + out.stderr
    taken = re.search(r"as the run that wrote \S+: (.*)", out.stdout)[1].split()
    assert {"amp=True", "amp_dtype=bf16", "ema=True", "fold_bn=True", "model.name=cifar_resnet", "model.width=8",
            "data.resolution=24", "data.train_size=512", "data.val_size=128"} <= set(taken)
    # fastnet's options, which the default model sets and the checkpoint's takes back, are not read: not listed
    assert not [t for t in taken if t.startswith(("model.widths", "model.stem_norm", "model.logit_scale"))], taken
    result, final = json.loads((tmp_path / "eval" / "summary.json").read_text()), trained.history[-1]
    # on a GPU another process may take other cuDNN algorithms, which round bf16 otherwise
    assert result["val_top1"] == final["val_top1"] and result["val_loss"] == pytest.approx(final["val_loss"], rel=1e-4)
    out = run(tmp_path / "export", "mode=export", *TINY, f"checkpoint={tmp_path / 'run'}")
    assert out.returncode == 0, out.stdout + out.stderr
    out = run(tmp_path / "other", "mode=eval", "model=resnet18", *TINY, f"checkpoint={tmp_path / 'run'}")
    assert out.returncode == 2 and ("model: checkpoint 'cifar_resnet', this run 'resnet18'; leave those options out: "
                                    "evaluation and export take them from the checkpoint") in out.stderr


def test_an_evaluation_of_a_checkpoint_that_kept_the_model_options_alone_says_what_to_give(tmp_path):
    """Checkpoints written before they kept every option of their run kept the model's alone:
    evaluated, one took the defaults' data (another size of the embedded set, which another
    training set's statistics normalize) without a word, as a resume did not. Export reads the
    model's alone, which the oldest did not keep either."""
    assert run(tmp_path / "run", *TINY, "trainer.epochs=1").returncode == 0
    path = find_checkpoint(tmp_path / "run")
    payload = torch.load(path, weights_only=True)
    written = payload["meta"].pop("config")
    payload["meta"]["options"] = {key: value for key, value in written.items()
                                  if key in ("amp", "amp_dtype", "ema", "fold_bn", "data.num_classes")
                                  or key.startswith("model.")}
    torch.save(payload, path)
    said = (f"[WARNING] - {path} was written before checkpoints kept every option of their run: give the options it "
            "was started with (its run's .hydra/overrides.yaml lists them)\n")
    out = run(tmp_path / "eval", "mode=eval", f"checkpoint={tmp_path / 'run'}")
    assert out.returncode == 0 and said in out.stdout + out.stderr, out.stdout + out.stderr
    out = run(tmp_path / "export", "mode=export", f"checkpoint={tmp_path / 'run'}")
    assert out.returncode == 0 and "WARNING" not in out.stdout + out.stderr, out.stdout + out.stderr
    del payload["meta"]["options"]  # older still: none kept, not the model's (a fast net's logit_scale is no tensor)
    torch.save(payload, path)
    out = run(tmp_path / "older", "mode=export", f"checkpoint={tmp_path / 'run'}")
    assert out.returncode == 0 and said in out.stdout + out.stderr, out.stdout + out.stderr


def test_a_command_line_gives_the_keys_it_names_its_groups_and_what_its_presets_change():
    """What a checkpoint's options may not override: a group's choice gives all its keys
    (model=cifar_resnet20 keeps its width 16 against a narrow checkpoint's 8), a preset
    the keys it sets and the groups it chooses, and data.num_classes the model's, which
    follows it."""
    from trainer.config import given_options, options, take_options
    defaults = config()
    assert given_options(config("optimizer.lr=0.1"), ["optimizer.lr"], defaults) == {"optimizer.lr"}
    group = given_options(config("model=cifar_resnet20"), ["model"], defaults)
    assert {"model.width", "model.depth", "model.name"} <= group
    assert given_options(config("data.num_classes=10"), ["data.num_classes"], defaults) == {"data.num_classes",
                                                                                            "model.num_classes"}
    assert "model.num_classes" in given_options(config("data=synthetic"), ["data"], defaults)  # as data's follows
    speed = given_options(config("+experiment=cifar10_speed", "data.root=c.tgz"), ["experiment", "data.root"], defaults)
    assert {"optimizer.lr", "trainer.batch_size", "model.logit_scale", "data.tta"} <= speed and "trainer.seed" not in speed
    # and the keys it sets to the defaults' values (momentum 0.9, flip random), and the groups it chooses
    from hydra import initialize_config_dir

    from trainer.config import chosen_keys
    with initialize_config_dir(str(CONF), version_base="1.3"):
        chosen = chosen_keys({"experiment": "cifar10_resnet18", "optimizer": "sgd", "trainer.seed": "3"})
    assert {"optimizer.momentum", "data.flip", "trainer.epochs", "model", "optimizer", "optimizer.name",
            "optimizer.lr"} <= chosen and "trainer.seed" not in chosen
    resnet18 = config("+experiment=cifar10_resnet18", "data.root=c.tgz")
    given = given_options(resnet18, {"experiment", "data.root", *chosen}, defaults)
    assert {"optimizer.momentum", "data.flip", "model.width"} <= given and "trainer.seed" not in given
    narrow = options(config("model=cifar_resnet20_narrow", "trainer.seed=3"))
    cfg = config("model=cifar_resnet20")
    assert take_options(cfg, narrow, ("model.width", "trainer.seed"), {"model.width", "model.name"}) == {
        "trainer.seed": 3}
    assert cfg.model.width == 16 and cfg.trainer.seed == 3


def test_training_and_evaluation_programs_are_told_apart(tmp_path):
    # mode=eval captures only keys(train=False): the evaluation variants, on both buffers
    from trainer.loop import Trainer
    executor = Trainer(config(*TINY), tmp_path, Dist(), evaluate_only=True).executor
    train, val = executor.keys(train=True), executor.keys(train=False)
    assert sorted(train + val) == sorted(executor.programs) and train and val
    assert all(name.startswith("train") for name, _ in train) and all(name.startswith("val") for name, _ in val)
    assert {buffer for _, buffer in val} == {"A", "B"}


def test_set_up_parts_time_the_model_and_plan_apart_from_slow_data(tmp_path, monkeypatch):
    """The data loads in a thread beside the model and its plan: each part reports its own
    time, so slow data shows as data, not as the model and plan it ran beside."""
    import trainer.loop
    from trainer.loop import Trainer
    build_sources = trainer.loop.build_sources
    monkeypatch.setattr(trainer.loop, "build_sources", lambda *a: time.sleep(2.0) or build_sources(*a))
    parts = Trainer(config(*TINY, "trainer.epochs=1"), tmp_path, Dist()).setup_parts
    assert parts["data"] >= 2.0 > parts["model_and_plan"]


def test_set_up_runs_the_ema_switch_and_restores_the_weights(tmp_path, monkeypatch):
    """Evaluation's eager EMA switch runs (so compiles) in set-up, there and back: the
    weights training starts from are the bound ones, bit for bit."""
    from trainer.loop import Trainer
    from trainer.range_ops import RangeOps
    calls, switch = [], RangeOps.sema_switch
    monkeypatch.setattr(RangeOps, "sema_switch", lambda ops: calls.append(1) or switch(ops))
    with_ema = Trainer(config(*TINY, "ema=true", "amp=true"), tmp_path / "ema", Dist())
    assert len(calls) == 2 and not with_ema.ops.ema_in_use
    monkeypatch.setattr(RangeOps, "sema_switch", lambda ops: None)
    without = Trainer(config(*TINY, "ema=true", "amp=true"), tmp_path / "plain", Dist())
    for first, last in ((R.W_BN_BIAS, R.W_DEEP_CONV), (R.E_BN_BIAS, R.E_DEEP_CONV), (R.A_FC_WEIGHT, R.A_DEEP_CONV)):
        assert torch.equal(with_ema.arena.flat(first, last), without.arena.flat(first, last)), first.name


def test_triton_kernels_train_like_torch_kernels(tmp_path):
    """kernels=triton (Triton's interpreter on the CPU) against kernels=torch, a short run:
    the residual blocks' ReLU masks packed, and read from their outputs
    (model.pack_relu_masks=false). (On a GPU: tests/test_gpu.py.) Four steps each, the
    three runs side by side: the interpreter runs a Python thread each."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    runs = [(name, subprocess.Popen(command(tmp_path / name, "device=cpu", f"kernels={kernels}", "optimizer=lars",
                                            "ema=true", "trainer.epochs=1", *more, "data.train_size=128",
                                            "data.val_size=64", "trainer.batch_size=32"),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env))
            for name, kernels, *more in (("torch", "torch"), ("triton", "triton"),
                                         ("outputs", "triton", "model.pack_relu_masks=false"))]
    states = []
    for name, process in runs:
        out = process.communicate(timeout=300)[0]
        assert process.returncode == 0, out
        states.append(checkpoint.read(tmp_path / name)["regions"])
    for name in ("W_BN_BIAS", "W_DEEP_CONV", "M_DEEP_CONV", "E_DEEP_CONV"):
        torch_run, *triton_runs = (s[name].view(torch.float32) for s in states)
        for run in triton_runs:
            torch.testing.assert_close(run, torch_run, rtol=1e-4, atol=1e-5, msg=name)


FREEZE = ["trainer.first_conv_freeze_epochs=1", "trainer.stem_norm_freeze_epochs=2", "optimizer=nesterov",
          "optimizer.weight_decay=0.01", "ema=true", "trainer.ema_every=2", "trainer.lookahead=true"]


def test_frozen_parts_stay_bit_identical_and_frozen_steps_skip_their_gradients(tmp_path):
    """The first conv frozen after epoch 1 and the stem's BatchNorm after epoch 2, under
    weight decay, momentum and lookahead: each stays bit for bit as it was at its freeze,
    running statistics included, and from epoch 2 on the steps run the `_frozen` programs,
    which compute no gradient for either and normalize with the fixed statistics."""
    from trainer.loop import Trainer
    # graphs=false: the hooks count Python calls, which a graph's replay does not make
    t = Trainer(config(*TINY, *FREEZE, "trainer.epochs=3", "graphs=false"), tmp_path, Dist())
    stem, norm = t.model.stem, t.model.stem_bn
    grads, batch_statistics = {"conv": 0, "bias": 0}, []
    stem.weight.register_post_accumulate_grad_hook(lambda p: grads.update(conv=grads["conv"] + 1))
    norm.bias.register_post_accumulate_grad_hook(lambda p: grads.update(bias=grads["bias"] + 1))
    norm.register_forward_hook(lambda m, i, o: batch_statistics.append(m.training))
    state = lambda: [x.detach().clone() for x in (stem.weight, norm.bias, norm.running_mean, norm.running_var)]
    seen = [state()]
    for epoch in range(3):
        t.train_epoch(epoch)()
        seen.append(state())
    assert not torch.equal(seen[0][0], seen[1][0]) and all(not torch.equal(a, b) for a, b in zip(seen[1][1:], seen[2][1:]))
    assert torch.equal(seen[1][0], seen[3][0]) and all(torch.equal(a, b) for a, b in zip(seen[2][1:], seen[3][1:]))
    # the plain programs compute both gradients until every freeze has happened
    assert grads == {"conv": 2 * t.per_epoch, "bias": 2 * t.per_epoch}
    assert batch_statistics == [True] * 2 * t.per_epoch + [False] * t.per_epoch
    assert [v.frozen for v in t.train_steps(2)] == [True] * t.per_epoch
    assert not any(v.frozen for v in t.train_steps(1))


@pytest.mark.parametrize("lookahead", [False, True])
def test_the_average_of_a_part_frozen_from_the_start_is_the_frozen_part(tmp_path, lookahead):
    """EMA averages the frozen first conv as it stays, not as the update moved it before it
    was put back: the averaged conv, which evaluation and export read, is the conv."""
    from trainer.loop import Trainer
    t = Trainer(config(*TINY, "trainer.first_conv_freeze_epochs=0", "optimizer=nesterov",
                       "optimizer.weight_decay=0.01", "ema=true", f"trainer.lookahead={lookahead}",
                       "trainer.epochs=1"), tmp_path, Dist())
    stem = t.plans.tensors["train_base"].params["stem.weight"]
    frozen = t.arena[stem.w].clone()
    t.train_epoch(0)()
    assert torch.equal(t.arena[stem.w], frozen) and torch.equal(t.arena[stem.e], frozen)


def test_freezing_a_stem_norm_the_model_lacks_is_a_clear_error(tmp_path):
    from trainer.errors import PlanError
    from trainer.loop import Trainer
    with pytest.raises(PlanError, match="stem_norm_freeze_epochs"):
        Trainer(config(*TINY, "model.stem_norm=none", "trainer.first_conv_freeze_epochs=0",
                       "trainer.stem_norm_freeze_epochs=1"), tmp_path, Dist())


@pytest.mark.parametrize("first_conv, stem_norm", [(-1, 2), (3, 2), (0, 0)])
def test_a_stem_norm_freezing_before_its_input_is_fixed_is_refused(first_conv, stem_norm):
    with pytest.raises(ConfigError, match="stem_norm_freeze_epochs"):
        config(f"trainer.first_conv_freeze_epochs={first_conv}", f"trainer.stem_norm_freeze_epochs={stem_norm}")


def test_bench_sets_our_step_beside_the_plain_loop_and_profiles_both():
    from trainer import bench
    cfg = config("mode=bench", "trainer.batch_size=32", "bench.steps=2", "bench.warmup=1",
                 "bench.baselines=[eager_bf16]", "bench.profile=3")
    text = bench.run(cfg, torch.device("cpu"), cfg.bench.optimizers)
    rows = table_rows(text.split("steps profiled:")[0])
    eager, ours = rows["eager_bf16"], rows["ours momentum fp32 eager"]
    assert eager[2] == "1.00x"
    assert eager[4] == ours[4] == "-"  # no peak memory measured on a CPU
    # the arena of the plan's tensors, as the plan sizes it (it read 0.00 GiB for a small model)
    from trainer.setup import make_plans
    cfg.optimizer.name = "momentum"
    arena = make_plans(cfg)[1].main.total_bytes
    assert f"ours momentum fp32 eager: its arena (the plan's persistent tensors) {arena / 2**20:,.1f} MiB" in text
    assert arena > 2**20
    ratio = float(ours[2].rstrip("x"))  # images/s against eager's, from the two timings
    assert ratio == pytest.approx(float(eager[0]) / float(ours[0]), rel=0.02)
    # each method's profile: its step's operators by their own time, which add up to a share of
    # the measured step; how large a share depends on the machine's load while the profiled
    # steps ran (2.3x the unprofiled median on a busy CPU), so only that they add up to some is checked
    assert [line for line in text.splitlines() if line.endswith("steps profiled:")] == \
        ["eager_bf16, 3 steps profiled:", "ours momentum fp32 eager, 3 steps profiled:"]
    for profiled in text.split("steps profiled:")[1:]:
        assert profile_share(profiled) > 0.1
        assert table_rows(profiled)["aten::convolution_backward"][0] == "7"  # the fast net's seven convolutions


def test_bench_out_appends_the_table_and_one_that_cannot_be_written_keeps_it_in_the_run(tmp_path):
    """bench.out in a folder that does not exist, or a folder, ended in a traceback after the
    whole benchmark had run, and its table was lost: refused before any timing. One that
    cannot be written by then is one line naming bench.md, which holds the table."""
    fast = ["mode=bench", "bench.steps=1", "bench.warmup=0", "bench.baselines=[]"]
    for out, said in [(tmp_path / "none" / "x.md", f"its folder {tmp_path / 'none'} does not exist; make it"),
                      (tmp_path, "is a folder: give a file to append the table to")]:
        with pytest.raises(ConfigError, match=re.escape(f"bench.out={out}") + ".*" + re.escape(said)):
            config(*fast, f"bench.out={out}")
    out = run(tmp_path / "a", *fast, "bench.out=notes.md", cwd=tmp_path)
    assert out.returncode == 0 and (tmp_path / "notes.md").read_text() == "\n" + (tmp_path / "a" / "bench.md").read_text()
    (tmp_path / "closed").mkdir(mode=0o555)
    for folder in (tmp_path / "closed", Path("/sys/kernel")):  # root writes in any folder of a disk; sysfs refuses it
        try:
            open(folder / "bench.md", "a").close()
        except OSError:
            break
    else:
        pytest.skip("this user writes in every folder at hand")
    out = run(tmp_path / "b", *fast, f"bench.out={folder / 'bench.md'}", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert (f"bench.out={folder / 'bench.md'} cannot be written" in out.stdout and
            f"the table is in {tmp_path / 'b' / 'bench.md'}\n" in out.stdout), out.stdout
    assert "| ours momentum" in (tmp_path / "b" / "bench.md").read_text()


def test_bench_profile_rows_sets_how_many_kernels_a_profile_lists():
    from trainer import bench
    cfg = config("mode=bench", "bench.steps=1", "bench.warmup=0", "bench.profile=1", "bench.profile_rows=2")
    x = torch.randn(32, 32)
    result = bench._measure(cfg, "matmuls", lambda: torch.relu(x @ x).softmax(0).sum(), time.perf_counter(),
                            torch.device("cpu"))
    header, total, *operators = table_rows(result.profile)
    assert header == "operator" and total.startswith("all, against the measured") and len(operators) == 2
    with pytest.raises(ConfigError, match="bench.profile_rows=0 must be positive"):
        config("mode=bench", "bench.profile_rows=0")


@pytest.mark.parametrize("name, kind", [  # kernels of ResNet-50's steps on an H200, as the profiler names them
    ("sm90_xmma_dgrad_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroup", "convolution dgrad"),
    ("sm90_xmma_fprop_image_first_layer_f16f16_f32_f16_nhwckrsc_nhwc_hmma_k64c4r7s7_stride2x2_ti", "convolution forward"),
    ("sm90_xmma_wgrad_indexed_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize64x64x64_war", "convolution wgrad"),
    ("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16_256x64_32x", "convolution forward"),
    ("nvjet_sm90_hsh_256x128_64x4_1x2_h_bz_coopA_TNT", "GEMM (cuBLAS, cuDNN)"),
    ("triton_red_fused__native_batch_norm_legit_functional_add_native_batch_norm_backward_thresh", "inductor reductions"),
    ("triton_poi_fused_add_threshold_backward_57", "inductor pointwise"),
    ("_bn_reduce_kernel", "BatchNorm (kernels/)"), ("_max_pool_backward_kernel", "max-pool (kernels/)"),
    ("_max_pool_kernel", "max-pool (kernels/)"),
    ("_sgd_kernel", "range ops (kernels/)"),
    ("void at::native::batch_norm_backward_elemt_channels_last_kernel<4, c10::BFloat16, float, f", "ATen, cuDNN BatchNorm"),
    ("void cudnn::bn_fw_tr_1C11_singleread_spec_kernel<float, float, float, 512, true, 1, 2, 1>", "ATen, cuDNN BatchNorm"),
    ("_lars_norms_kernel", "range ops (kernels/)"), ("_bn_backward_apply_kernel", "BatchNorm (kernels/)"),
    ("_bn_normalize_kernel", "BatchNorm (kernels/)"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat1", "ATen other"),
    ("[CUDA memset]", "memset, memcpy")])
def test_a_profiled_kernel_is_counted_under_its_kind(name, kind):
    from trainer.bench import kernel_kind
    assert kernel_kind(name) == kind


@pytest.mark.parametrize("overrides", [["data.cutout=8"], ["data=imagefolder", "data.root=x", "data.cutout=8"]])
def test_cutout_beyond_the_resident_small_images_is_refused(overrides):
    with pytest.raises(ConfigError, match="data.cutout"):
        config(*overrides)


@pytest.mark.parametrize("overrides, message", [
    (["+trainer.bach_size=4"], r"\+trainer.bach_size: the configuration has no such key"),
    (["+foo=1"], r"\+foo: the configuration has no such key"),
    (["data.tta=3"], "data.tta=3 is not one of: 0, 1, 2"),
    (["dist.timeout_s=-5"], "dist.timeout_s=-5 must be positive"),
    (["schedule=step", "schedule.milestones=[1]", "schedule.gamma=-1"], "schedule.gamma=-1.0 must not be negative"),
    (["schedule=step", "schedule.milestones=[-1]"], r"schedule.milestones=\[-1.0\] must be epochs"),
    (["checkpoint=/runs/a"], "checkpoint=/runs/a is read by mode=eval and mode=export only; to continue training "
                             "from it use trainer.resume=/runs/a"),
    (["trainer.lookahead=true"], "trainer.lookahead=true copies the EMA weights back .* ema=false keeps none"),
    (["optimizer=sgd", "optimizer.momentum=0.9"], "optimizer.momentum=0.9 with optimizer=sgd, which keeps no momentum "
                                                  "buffer and would ignore it: use optimizer=momentum"),
    (["trainer.seed=99999999999999999999"], r"trainer.seed=99999999999999999999 must lie in \[-2\*\*63, 2\*\*64\)"),
    (["data.val_resize=-1.14"], "data.val_resize=-1.14 must be at least 1"),  # DALI flipped the images
    (["data.val_resize=0.5"], "data.val_resize=0.5 must be at least 1"),  # failed at the first evaluation
    (["data.min_crop_area=0"], r"data.min_crop_area=0.0 must lie in \(0, 1\)"),
    (["optimizer=adamw", "optimizer.decoupled=true"], "optimizer.decoupled=true with optimizer=adamw: its units are"),
    (["optimizer.decoupled=true", "optimizer.nominal_batch=256"], "already scales with the batch"),
    (["mode=bench", "bench.baselines=[]", "bench.optimizers=[]"], "mode=bench has nothing to time"),  # an empty table
    # two rows of one name: the first eager_bf16's ratio against itself read 0.98x, the later row's time its base
    (["mode=bench", "bench.baselines=[eager_bf16,compile_bf16,eager_bf16]"],
     re.escape("bench.baselines=[eager_bf16,compile_bf16,eager_bf16] names eager_bf16 more than once")),
    (["mode=bench", "bench.optimizers=[lars,momentum,lars]"], "bench.optimizers=.* names lars more than once"),
])
def test_settings_that_would_be_ignored_or_misread_are_refused(overrides, message):
    """Each would otherwise train without a word, or fail in a traceback: a key added by +
    beside the schema's (a misspelling Hydra's own advice leads to), a view count the
    evaluation does not know, a learning rate turned negative, a checkpoint that training
    does not read, lookahead without the EMA it reads, momentum for the optimizer without
    it, a seed the generators cannot take."""
    with pytest.raises(ConfigError, match=message):
        config(*overrides)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.batch_size=1"], r"a training batch of one image \(train_base: .* BatchNorms at 1x1 one value a "
                               "channel to normalize over; change trainer.batch_size"),
    (["trainer.drop_last=false", "data.train_size=513"], r"\(train_last: .*or set trainer.drop_last=true"),
    (["data.resolution=7"], "7x7 images are too small for model=fastnet .*; raise data.resolution"),
])
def test_inputs_the_model_cannot_train_on_are_refused_before_set_up(tmp_path, overrides, message):
    """The fast net's last BatchNorms see 1x1 maps: one image a batch leaves them one value to
    normalize over, and 7x7 images shrink to nothing; said before set-up, not as torch's
    error at the first step."""
    from trainer.loop import Trainer
    with pytest.raises(ConfigError, match=message):
        Trainer(config(*TINY, *overrides), tmp_path, Dist())


def test_a_data_set_without_its_root_names_what_to_give():
    """data=imagefolder offered an archive, which it then refused as a file."""
    for name, held in (("cifar10", "a folder or .tgz of the data set"), ("imagefolder", "a folder of train/ and val/")):
        with pytest.raises(ConfigError, match=f"^data={name} needs data.root=PATH \\({held}\\)$"):
            config(f"data={name}")


def test_more_ranks_than_training_examples_are_refused_whatever_the_batch():
    """A rank with no example: the batch size was blamed (lowering it did not help), and
    with drop_last off each rank ended in numpy's traceback, or mode=plan planned the job."""
    from trainer.setup import make_plans
    for drop_last in ("true", "false"):
        with pytest.raises(ConfigError, match="^the 256 training examples are fewer than the job's 300 ranks: raise "
                                              "data.train_size, or start fewer processes$"):
            make_plans(config("data.train_size=256", "trainer.batch_size=2", f"trainer.drop_last={drop_last}"), 300)


def test_the_check_of_the_inputs_leaves_the_model_as_it_was():
    """The check runs the model itself, in eval mode: afterwards it trains as before, with no
    hook left on its BatchNorms and their statistics as they were."""
    from trainer.setup import make_plans
    model = make_plans(config(*TINY, "model=cifar_resnet20"))[0]
    assert model.training and all(m.training for m in model.modules())
    assert not any(m._forward_pre_hooks for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(m.running_mean.eq(0).all() and m.running_var.eq(1).all() and m.num_batches_tracked == 0
                         for m in norms)


def test_a_run_starts_without_importing_the_compilers(tmp_path):
    """torch._dynamo and inductor take a second or two of every start-up to import, and
    torchvision (whose ops import torch._dynamo) one more; a run of a model without
    torchvision's blocks (the fast net here), without compile=true, trains without them,
    on a GPU with the Triton kernels too."""
    imports_at_the_end = f"""
import atexit, runpy, sys
atexit.register(lambda: print("imported:", [m for m in ("torch._dynamo", "torch._inductor", "torchvision")
                                            if m in sys.modules]))
sys.argv = {command(tmp_path / "run", *TINY, "trainer.epochs=1")[1:]!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    out = subprocess.run([sys.executable, "-c", imports_at_the_end], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "imported: []" in out.stdout, out.stdout


def test_one_image_a_batch_trains_where_the_batchnorms_see_more_than_one_pixel(tmp_path):
    trained = train(tmp_path, "model=cifar_resnet20", "trainer.batch_size=1", "data.train_size=8", "data.val_size=4",
                    "trainer.epochs=1")
    assert trained.per_epoch == 8 and math.isfinite(trained.history[-1]["train_loss"])


@pytest.mark.parametrize("key", ["trainer.eval_every", "trainer.keep_checkpoints"])
def test_no_evaluations_or_no_checkpoints_kept_are_refused(key):
    """Every 0th epoch has no meaning, and keeping none would delete the checkpoint just written."""
    with pytest.raises(ConfigError, match=f"{key}=0 must be positive"):
        config(f"{key}=0")


def test_a_data_root_without_a_data_set_that_reads_it_is_refused():
    """data.root on the default, generated data set would silently train on that set."""
    with pytest.raises(ConfigError, match="data.root=/data with data=synthetic.*add data=cifar10"):
        config("data.root=/data")
    assert config("data=cifar10", "data.root=/data").data.root == "/data"


@pytest.mark.parametrize("tuning", [None, False])
def test_compile_options_reach_inductor_with_their_dotted_names_over_the_defaults(tuning):
    """The compiled forward of every program runs under the options; nested groups arrive
    with inductor's dotted names, and a given option overrides the trainer's default."""
    from trainer.setup import assemble
    given = [] if tuning is None else [f"+compile_options.coordinate_descent_tuning={str(tuning).lower()}"]
    cfg = config(*TINY, "compile=true", "+compile_options.triton.persistent_reductions=false", *given)
    engine = assemble(cfg, torch.device("cpu"))
    for program in engine.programs.values():
        inductor = program.forward.get_compiler_config()
        assert inductor["triton.persistent_reductions"] is False
        assert inductor["coordinate_descent_tuning"] is (tuning is None)  # on by default
        assert inductor["use_static_cuda_launcher"] is False  # keeps the tuning in the cache


def test_convolutions_are_tuned_one_by_one_and_training_state_is_left_alone():
    """Before the first step, cuDNN's autotuning runs each convolution's forward and its
    backward alone (the first conv's without a gradient for the input, as in the step),
    and leaves the arena (weights, gradient slots, BatchNorm statistics), the .grad slots
    and the training mode as they were."""
    from torch import nn

    from trainer.executor import tune_convolutions
    from trainer.setup import assemble
    engine = assemble(config(*TINY, "amp=true"), torch.device("cpu"))
    program = next(p for p in engine.programs.values() if p.variant.train)
    model, before = program.model, engine.arena.storage.clone()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    forwards, weight_grads, input_grads = {}, {}, []

    def watch(conv, args):
        forwards[conv] = forwards.get(conv, 0) + 1
        if args[0].requires_grad:
            args[0].register_hook(lambda g: input_grads.append(conv))
    for conv in convs:
        conv.register_forward_pre_hook(watch)
        conv.weight.register_hook(lambda g, m=conv: weight_grads.__setitem__(m, weight_grads.get(m, 0) + 1))
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.train()
    tune_convolutions(model, program.x)
    assert len(convs) > 5 and all(forwards[c] == 2 for c in convs)  # the evaluation pass, then alone
    assert all(weight_grads[c] == 1 for c in convs)
    assert convs[0] not in input_grads and set(input_grads) == set(convs[1:])
    assert torch.equal(engine.arena.storage, before)
    assert all(p.grad is grads[n] for n, p in model.named_parameters()) and model.training


@pytest.mark.parametrize("given, autotune", [([], True), (["model.cudnn_benchmark=false"], False),
                                             (["model=resnet50"], False),
                                             (["model=resnet50", "model.cudnn_benchmark=true"], True)])
def test_cudnn_autotuning_follows_the_model_config(given, autotune, monkeypatch):
    """On by default; model.cudnn_benchmark=false leaves cuDNN's heuristic choice, which
    ResNet-50's config takes because it is as fast there."""
    from trainer.setup import use_device
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", not autotune)
    use_device(torch.device("cpu"), config(*TINY, *given))
    assert torch.backends.cudnn.benchmark is autotune


def test_deterministic_takes_fixed_order_kernels_and_false_gives_them_back():
    """deterministic=true: cuDNN's deterministic algorithms by its heuristic, even where the
    model's config autotunes, torch's deterministic kernels (and so inductor's fixed
    reduction configurations) and cuBLAS with one workspace; the next run's config puts
    the process back."""
    from trainer.setup import use_device
    try:
        use_device(torch.device("cpu"), config(*TINY, "deterministic=true"))
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"]
    finally:
        use_device(torch.device("cpu"), config(*TINY))
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert torch.backends.cudnn.benchmark


def test_bench_pays_the_processs_one_off_costs_before_it_times_any_method():
    """The first method's first step paid them (torch._dynamo's import by the optimizer's first
    step: 1.5 s on a CPU), and so seemed seconds slower than the same method run later; on a
    fresh process the step of any method after the warm-up imports nothing more."""
    script = """
import sys, torch
from trainer import bench
calls = []
bench.warm_process, warm = (lambda device: calls.append("warm") or warm(device)), bench.warm_process
bench._plain_loop = lambda cfg, method, device, stop: calls.append(method) or 0
from trainer.config import compose_config
cfg = compose_config(["mode=bench", "bench.baselines=[eager_bf16]"])
bench.ours = lambda cfg, device: calls.append("ours")
bench.table = lambda *args: ""
bench.run(cfg, torch.device("cpu"), ["momentum"])
before = set(sys.modules)
m = torch.nn.Conv2d(3, 4, 3)
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
with torch.autocast("cpu", dtype=torch.bfloat16):
    m(torch.randn(2, 3, 8, 8)).float().sum().backward()
opt.step()
print(calls, sorted(set(sys.modules) - before))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "['warm', 'eager_bf16', 'ours'] []", out.stdout + out.stderr


def test_bench_times_the_plain_loops_with_autotuning_whatever_ours_uses(monkeypatch):
    """The hand-written loop a user tunes for speed autotunes cuDNN; model.cudnn_benchmark=false
    is a setting of ours alone, and it holds again for our step. bench.baseline_autotune=false
    times the plain loops as torch leaves cuDNN, and a GPU's table says so, as it says that
    deterministic=true holds for every method; a CPU's says nothing of cuDNN."""
    from trainer import bench
    seen = []

    def measure(cfg, method, step, t0, device):
        seen.append((method, torch.backends.cudnn.benchmark))
        return bench.Result(method, 1.0, 1.0, 0.0, 0.0)
    monkeypatch.setattr(bench, "_measure", measure)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    cfg = config("mode=bench", "trainer.batch_size=32", "model.cudnn_benchmark=false", "bench.baselines=[eager_bf16]")
    assert "cuDNN" not in bench.run(cfg, torch.device("cpu"), cfg.bench.optimizers)
    assert "a GPU, torch" in bench.table(cfg, [], torch.device("cuda")) and \
        "the plain loops autotune cuDNN" in bench.table(cfg, [], torch.device("cuda"))
    assert seen == [("eager_bf16", True), ("ours momentum fp32 eager", False)]
    seen.clear()  # the loop as torch leaves it, beside ours autotuning
    cfg = config("mode=bench", "trainer.batch_size=32", "bench.baseline_autotune=false", "bench.baselines=[eager_bf16]")
    bench.run(cfg, torch.device("cpu"), cfg.bench.optimizers)
    assert "the plain loops take cuDNN's heuristic choice" in bench.table(cfg, [], torch.device("cuda"))
    assert seen == [("eager_bf16", False), ("ours momentum fp32 eager", True)]
    seen.clear()  # deterministic=true holds for every method, and the table says so
    cfg = config("mode=bench", "trainer.batch_size=32", "deterministic=true", "bench.baselines=[eager_bf16]")
    assert "every method runs deterministic kernels only" in bench.run(cfg, torch.device("cpu"), cfg.bench.optimizers)
    assert seen == [("eager_bf16", True), ("ours momentum fp32 eager", False)]


def test_a_compiled_run_with_folded_evaluation_compiles_training_and_evaluation_once(tmp_path):
    """Each evaluation swaps the folded BatchNorm in and out again. Under compile=true the
    swapped-in forward must be the same object every time: a new one made inductor compile
    the evaluation and then the training step again every epoch, and after eight compiles
    the run went on uncompiled."""
    from torch._dynamo.utils import counters

    from trainer.loop import Trainer
    torch._dynamo.reset()
    counters.clear()  # reset() keeps them: other tests' compiles would count
    Trainer(config(*TINY, "compile=true", "fold_bn=true", "trainer.epochs=2", "model=cifar_resnet20_narrow",
                   "data.resolution=16"), tmp_path, Dist()).fit()
    assert counters["frames"]["ok"] == 2  # the training step's forward, the evaluation's


@pytest.mark.parametrize("sync", [False, True])
def test_forward_runs_without_gradients_and_each_step_leaves_them_in_their_slots(sync):
    """A compiled forward traces the .grad it finds on each parameter: arena views, which
    Dynamo traced with symbolic offsets and guards (4 s of ResNet-50's 13 s warm set-up on a
    CPU). Training and evaluation programs run forward with .grad released, and leave each
    .grad its slot. Under a gradient sync, backward accumulates into the slots themselves,
    whose buckets it reduces as they fill."""
    from trainer.setup import assemble
    syncs = []
    engine = assemble(config(*TINY), torch.device("cpu"),
                      grad_sync_factory=(lambda ops: lambda: syncs.append(1)) if sync else None)
    params = list(engine.model.parameters())
    slots = [p.grad.data_ptr() for p in params]
    seen, in_slot = [], []

    def forward(x):
        seen.append(all(p.grad is None for p in params))
        return engine.model(x)

    for p, slot in zip(params, slots):
        p.register_post_accumulate_grad_hook(lambda p, slot=slot: in_slot.append(p.grad.data_ptr() == slot))
    for key, program in engine.programs.items():
        program.forward = forward
        engine.executor.run(*key)
    assert len(seen) >= 2 and all(seen)
    assert [p.grad.data_ptr() for p in params] == slots
    assert len(syncs) == (2 if sync else 0)  # once per training program
    assert in_slot and all(in_slot) == sync  # without a sync autograd keeps its own tensors


def test_set_up_gives_the_stem_pool_the_kernels_backward():
    """ResNet's nn.MaxPool2d comes from the run's kernels (here the torch reference), and
    all it keeps for its backward is the int8 positions: no int64 indices, not its input."""
    from kernels import reference
    from trainer.pooling import MaxPool2d
    from trainer.setup import assemble
    model = assemble(config(*TINY, "model=resnet18", "data.resolution=32"), torch.device("cpu")).model
    assert type(model.maxpool) is MaxPool2d and model.maxpool.pool_kernel is reference.max_pool
    assert model.maxpool.backward_kernel is reference.max_pool_backward
    x = torch.randn(2, 64, 16, 16, requires_grad=True)
    y = model.maxpool(x)
    assert [(t.dtype, t.shape) for t in y.grad_fn.saved_tensors] == [(torch.int8, (2 * 8 * 8, 64))]


@pytest.mark.parametrize("compile_, kernels, pack", [
    (False, "torch", True), (True, "torch", True),
    *(pytest.param(False, "triton", pack, marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="Triton's interpreter serves the CPU; on a GPU tests/test_gpu.py runs them"))
      for pack in (True, False))])
def test_set_up_gives_batch_norm_the_kernels_where_they_are_faster(compile_, kernels, pack, monkeypatch):
    """With inductor to fuse the normalization, BatchNorm's statistics and backward come
    from the run's kernels and the blocks' ReLUs and residual adds are folded into their
    BatchNorms. Without it the Triton kernels (Triton's interpreter here) normalize, add
    and apply the ReLU too, in one pass, keeping the ReLU's mask packed as
    model.pack_relu_masks says, and the mean-pool gives its gradient broadcast; the torch
    reference's form would be slower than ATen's BatchNorm, which stays."""
    from trainer.norm import BatchNorm2d
    from trainer.pooling import MeanPool2d
    from trainer.setup import assemble
    from trainer.torchvision_blocks import Bottleneck
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = assemble(config(*TINY, "model=resnet50", "data.resolution=32", f"compile={str(compile_).lower()}",
                            f"kernels={kernels}", f"model.pack_relu_masks={str(pack).lower()}"),
                     torch.device("cpu")).model
    swapped = compile_ or kernels == "triton"
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 53 and all((type(m) is BatchNorm2d) == swapped for m in norms)
    assert (type(model.layer1[0]) is Bottleneck) == swapped
    if swapped:
        assert model.bn1.relu and model.layer1[0].bn3.relu
        assert model.bn1.kernels.__name__ == {"torch": "kernels.reference", "triton": "kernels.triton_ops"}[kernels]
        assert all(m.normalize == (not compile_) and m.pack_masks == pack for m in norms)
    assert (type(model.avgpool) is MeanPool2d) == (swapped and not compile_)


@pytest.mark.parametrize("overrides, message", [
    (["+compile_options.coordinate_descent_tuning=true"], "only apply with compile=true"),
    (["compile=true", "+compile_options.coordinate_descent_tunning=true"], "not an inductor setting"),
    (["compile=true", "+compile_options.triton.nope=1"], "triton.nope: not an inductor setting"),
    (["compile=true", "+compile_options.coordinate_descent_tuning=1"], "expects a bool"),
])
def test_a_wrong_compile_option_is_refused_before_set_up(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(*overrides)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for CPU runs")
@pytest.mark.parametrize("amp,warned", [(["amp=true"], True), (["amp=true", "amp_dtype=bf16"], False), ([], False)])
def test_fp16_on_the_cpu_is_warned_about(tmp_path, caplog, amp, warned):
    from trainer.loop import Trainer
    with caplog.at_level(logging.WARNING, logger="trainer"):
        Trainer(config(*TINY, *amp), tmp_path, Dist())
    assert ("amp_dtype=bf16 is faster" in caplog.text) == warned, caplog.text


def test_accuracies_are_hits_over_examples_exactly(tmp_path):
    """Top-1 and top-5, training and evaluation, are the floats nearest hits / examples: 14
    of 14 is 1.0, where epoch sums of fp32 means times counts read 1.0000001."""
    from trainer.loop import Trainer
    # batches of 28 and a last one of 14: means of a batch are not exact in fp32 either way
    trainer = Trainer(config("trainer.epochs=3", "data.train_size=434", "trainer.batch_size=28", "trainer.drop_last=false",
                             "data.val_size=14", "trainer.val_batch_size=14"), tmp_path, Dist())
    trainer.fit()
    assert len(trainer.history) == 3
    for row in trainer.history:
        for split, examples in (("train", 434), ("val", 14)):
            for key in (f"{split}_top1", f"{split}_top5"):
                assert row[key] == round(row[key] * examples) / examples, (key, row)


@pytest.mark.parametrize("sent, status, said", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "terminated")], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_during_the_benchmark_is_one_line(tmp_path, sent, status, said):
    """Interrupted while a plain loop steps in its thread, mode=bench ends as training does:
    it used to exit under the running thread, which aborted (exit 134)."""
    with started(command(tmp_path / "bench", "mode=bench", "bench.baselines=[eager_bf16]", "bench.warmup=0",
                         "bench.steps=5000"), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        printed = ""
        while "timing eager_bf16" not in printed:  # logged in the loop's thread as its steps begin
            line = proc.stdout.readline()
            assert line, printed  # the run ended (its steps are bounded for this) without the line
            printed += line
        proc.send_signal(sent)
        printed += proc.communicate(timeout=60)[0]
    assert proc.returncode == status, printed
    assert said in printed and "terminate called" not in printed and "Traceback" not in printed, printed


def a_damaged_val_image(monkeypatch):
    """Every evaluation from here on fails, as a damaged validation image fails it as it is decoded."""
    from trainer.errors import DataError
    from trainer.loop import Trainer
    run_steps = Trainer.run_steps

    def failing(self, steps, source, on_step=None):
        if source is self.val_source:
            raise DataError("cannot decode val/img_7.JPEG: the file is damaged")
        return run_steps(self, steps, source, on_step)
    monkeypatch.setattr(Trainer, "run_steps", failing)


def test_a_failed_evaluation_keeps_the_epoch_it_followed_in_a_checkpoint(tmp_path, monkeypatch):
    """A validation image found damaged (data.check_files=false) ended the run before the
    epoch just trained was saved: a resume trained it again. Now its checkpoint is written,
    with its training row, and under EMA with the live weights, not the EMA weights evaluation
    swaps in: a resume after the data is mended ends as an uninterrupted run."""
    from trainer.errors import DataError
    common = ["trainer.epochs=3", "ema=true", "deterministic=true"]
    straight = train(tmp_path / "straight", *common)
    a_damaged_val_image(monkeypatch)
    with pytest.raises(DataError, match="cannot decode"):
        train(tmp_path / "a", *common)
    written = checkpoint.read(tmp_path / "a" / "checkpoints")["meta"]
    assert written["epoch"] == 1 and [set(row) for row in written["history"]] == [
        {"epoch", "train_loss", "train_top1", "train_top5"}]
    monkeypatch.undo()
    resumed = train(tmp_path / "a", *common, f"trainer.resume={tmp_path / 'a'}")
    assert [row["epoch"] for row in resumed.history] == [1, 2, 3]
    assert_same_state(persistent_state(resumed.arena), persistent_state(straight.arena))


def test_a_failed_last_evaluation_is_done_by_the_resume_once_the_data_is_mended(tmp_path, monkeypatch):
    """The last epoch's evaluation failed (a damaged image) after the epoch was saved: the
    resume found nothing left to train, and the run's summary kept no evaluation for good.
    Now the resume evaluates it, records it, and saves it with the checkpoint; a resume
    after that has nothing left to do."""
    from trainer.errors import DataError
    from trainer.loop import Trainer
    common = ["trainer.epochs=2", "trainer.eval_every=2"]
    straight = train(tmp_path / "straight", *common)
    a_damaged_val_image(monkeypatch)
    with pytest.raises(DataError):
        train(tmp_path / "a", *common)
    monkeypatch.undo()
    resume = f"trainer.resume={tmp_path / 'a'}"
    resumed = Trainer(config(*TINY, *common, resume), tmp_path / "a", Dist())
    assert resumed.unevaluated
    trained = json.loads((tmp_path / "a" / "summary.json").read_text())
    summary = resumed.fit()
    assert summary["val_loss"] == straight.history[-1]["val_loss"] and summary["val_epoch"] == 2
    # the training's figures are the run's, not those of the evaluation alone (0 s, none a second)
    assert trained["train_s"] > 0 and (summary["train_s"], summary["images_per_s"]) == (
        trained["train_s"], trained["images_per_s"])
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["val_loss"] == summary["val_loss"]
    assert checkpoint.read(tmp_path / "a")["meta"]["history"][-1]["val_loss"] == summary["val_loss"]
    assert not Trainer(config(*TINY, *common, resume), tmp_path / "a", Dist()).unevaluated


def test_a_resume_after_the_training_set_changed_says_so_not_which_options_differ(tmp_path, monkeypatch, caplog):
    """Images added to the data set (data.train_size=0: all of them) make more steps an
    epoch; the refusal blamed the batch size, data.train_size, drop_last or the ranks, none
    of which differed. A checkpoint written before the size was kept, or another
    data.train_size, keeps the list of options. Images added that leave the epochs as long
    are said, where the run went on without a word."""
    from trainer.loop import Trainer
    all_of_them = ["data.train_size=0", "data.val_size=128", "trainer.batch_size=32", "trainer.epochs=2"]
    monkeypatch.setattr("trainer.data._SYNTHETIC_DEFAULT", (384, 128))
    train(tmp_path / "a", *all_of_them, "trainer.stop_after_epoch=1")
    monkeypatch.setattr("trainer.data._SYNTHETIC_DEFAULT", (512, 128))  # 128 images added
    resume = f"trainer.resume={tmp_path / 'a'}"
    with pytest.raises(ConfigError, match=r"trained in epochs of 12 steps, and this run's have 16: its training set "
                                          r"had 384 examples and this run's has 512: the data set changed; "
                                          r"restore it, or start a new run$"):
        Trainer(config(*all_of_them, resume), tmp_path / "a", Dist())
    with pytest.raises(ConfigError, match="have 16: trainer.batch_size, data.train_size, trainer.drop_last"):
        Trainer(config(*all_of_them[1:], "data.train_size=512", resume), tmp_path / "a", Dist())
    monkeypatch.setattr("trainer.data._SYNTHETIC_DEFAULT", (390, 128))  # 6 added: 12 steps an epoch still
    with caplog.at_level("WARNING", logger="trainer"):
        Trainer(config(*all_of_them, resume), tmp_path / "a", Dist())
    assert "was trained on 384 examples and this run's training set has 390: the data set changed; the run goes on " \
           "with it, in epochs of the same 12 steps" in caplog.text
    monkeypatch.setattr("trainer.data._SYNTHETIC_DEFAULT", (512, 128))
    path = find_checkpoint(tmp_path / "a")
    payload = torch.load(path, weights_only=True)
    del payload["meta"]["train_examples"]  # as written before it was kept
    torch.save(payload, path)
    with pytest.raises(ConfigError, match="have 16: trainer.batch_size, data.train_size, trainer.drop_last"):
        Trainer(config(*all_of_them, resume), tmp_path / "a", Dist())


def test_a_resume_on_other_schedule_options_says_where_the_learning_rate_moves_from_the_checkpoints(tmp_path, caplog):
    """The learning rate before the resume was computed with this run's schedule options,
    not the checkpoint's ("0.5 of its peak, where it was 0.5" for a cosine that was at
    0.854), and a change of the schedule alone (schedule=constant) was not said at all."""
    from trainer.loop import Trainer
    train(tmp_path / "a", "trainer.epochs=4", "trainer.stop_after_epoch=1")

    def warned(*overrides):
        caplog.clear()
        with caplog.at_level("WARNING", logger="trainer"):
            Trainer(config(*TINY, *overrides, f"trainer.resume={tmp_path / 'a'}"), tmp_path / "a", Dist())
        return caplog.text
    # the cosine over 64 steps is at 0.854 of its peak after 16; two epochs of warm-up reach 0.5 of it;
    # the step is numbered as its metrics row is, from 1 (it said 16)
    assert re.search(r"trained on a schedule of 64 steps and this run's has 128 \(another trainer.epochs\) and "
                     r"schedule.warmup_epochs=2.0 \(was 0.0\): the learning rate at step 17 is 0.5 of its peak, "
                     r"where it was 0.854", warned("trainer.epochs=8", "schedule.warmup_epochs=2"))
    assert re.search(r"trained on another schedule: this run's schedule.name=constant \(was cosine\): the learning "
                     r"rate at step 17 is 1 of its peak, where it was 0.854",
                     warned("trainer.epochs=4", "schedule=constant"))
    assert "learning rate" not in warned("trainer.epochs=4")
    train(tmp_path / "a", "trainer.epochs=4", "schedule=constant", "trainer.stop_after_epoch=2", "trainer.log_every=1",
          f"trainer.resume={tmp_path / 'a'}")
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    lr = {row["step"]: row["lr"] for row in rows if "step" in row}
    assert lr[17] == lr[18] == pytest.approx(config(*TINY).optimizer.lr) and lr[16] < lr[17]  # the cosine, then constant


def test_a_validation_loss_warning_does_not_contradict_the_divergence_stopping_the_run(tmp_path, caplog, monkeypatch):
    """A diverged run evaluates to NaN too (LARS at 1e6 on the default data): the warning that
    the validation loss is NaN "although training's is not" came just before the error that
    training diverged. Only a training loss that passed its check is called finite."""
    from trainer.loop import Trainer
    evaluate = Trainer.evaluate

    def overflowing(self, *args, **kwargs):
        self.arena.flat(R.B_NEXT_VAR).fill_(-1.0)  # statistics that make evaluation overflow
        return evaluate(self, *args, **kwargs)
    monkeypatch.setattr(Trainer, "evaluate", overflowing)
    with caplog.at_level("WARNING", logger="trainer"):
        train(tmp_path / "a", "trainer.epochs=1")
    assert caplog.text.count("the validation loss is NaN or infinite although training's is not") == 1, caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainer"), pytest.raises(DivergedError, match="training diverged"):
        train(tmp_path / "b", "optimizer.lr=1e9", "trainer.epochs=2")
    assert "validation loss" not in caplog.text


def test_the_throughput_script_counts_a_resumed_steps_later_row(tmp_path):
    """bench/throughput.py took every row of the last epoch: a run resumed inside it had the
    interrupted attempt's rows and the resumed attempt's first, which has no rate (a
    traceback comparing None)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("throughput", ROOT / "bench" / "throughput.py")
    throughput = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(throughput)
    rows = [{"step": 1, "epoch": 1, "images_per_s": None}, {"step": 2, "epoch": 2, "images_per_s": 50.0},
            {"step": 3, "epoch": 2, "images_per_s": 100.0}, {"step": 4, "epoch": 2, "images_per_s": 1.0},
            # the run, interrupted after step 4, resumed after step 2: step 3 again, then 4 and 5
            {"step": 3, "epoch": 2, "images_per_s": None}, {"step": 4, "epoch": 2, "images_per_s": 200.0},
            {"step": 5, "epoch": 2, "images_per_s": 300.0}, {"epoch": 2, "train_loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text("{}")
    rate, count, _ = throughput.steady(tmp_path)
    assert (rate, count) == (250.0, 2)  # steps 4 and 5 as resumed; step 2, the epoch's first, left out
