"""run.py's command line around the run itself: signals between a sweep's jobs, the folders
a sweep's jobs take, and the messages for what Hydra or OmegaConf refuse."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_py
from tests.test_trainer import command, from_a_terminal, run, started

SMALL = ["data.train_size=512", "data.val_size=128"]  # a run whose data size does not matter: seconds less


def test_sigterm_between_a_sweeps_jobs_is_one_line(tmp_path):
    """A scheduler preempting a sweep: SIGTERM while Hydra writes the next job's .hydra/
    ended in a traceback and exit 1, where a job's own run says "terminated", exit 143."""
    term_between_jobs = f"""
import runpy, signal, sys
from hydra.core import utils
save = utils._save_config
def term_at_the_second_job(cfg, filename, output_dir):
    if output_dir.parent.name == "1":
        signal.raise_signal(signal.SIGTERM)
    save(cfg, filename, output_dir)
utils._save_config = term_at_the_second_job
sys.argv = {command(tmp_path / "sweep", "mode=plan", "trainer.seed=1,2,3", multirun=True)[1:]!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    out = subprocess.run([sys.executable, "-c", term_between_jobs], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120, preexec_fn=from_a_terminal)
    assert (out.returncode, out.stderr.splitlines()[-1:]) == (143, ["terminated"]), out.stderr
    assert "Traceback" not in out.stderr and (tmp_path / "sweep" / "0" / "plan.json").exists()


A_BUG = """
import runpy, sys
from trainer import app
def a_bug(cfg, run_dir):
    raise RuntimeError("a bug in the trainer")
app.MODES["plan"] = a_bug
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("multirun", [False, True])
def test_an_unexpected_error_prints_its_traceback_once_and_keeps_it_in_the_log(tmp_path, multirun):
    """An error that is no refusal (a bug): its traceback was printed twice, by the run's log on
    the console and by Hydra. A sweep's job, whose failure Hydra does not print, prints it once
    too, and the sweep goes on to its next job."""
    argv = command(tmp_path / "run", "mode=plan", *(["trainer.seed=1,2"] if multirun else []), multirun=multirun)[1:]
    out = subprocess.run([sys.executable, "-c", A_BUG.format(argv=argv)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode != 0
    said = out.stdout + out.stderr
    assert said.count("Traceback (most recent call last)") == (2 if multirun else 1), said
    assert "RuntimeError: a bug in the trainer" in said
    logs = sorted((tmp_path / "run").glob("**/run.log"))
    assert len(logs) == (2 if multirun else 1)
    assert all("RuntimeError: a bug in the trainer" in log.read_text() for log in logs)


SIGNALLED_IMPORT = """
import runpy, signal, sys
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            def inside(frame, event, arg):  # the first Python call from its native initialization
                if event == "call" and not frame.f_code.co_filename.startswith("<frozen"):
                    sys.setprofile(None)
                    for _ in range({times}):
                        signal.raise_signal({sent})
            sys.setprofile(inside)
sys.meta_path.insert(0, Hook())
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("module, sent, times, status, said", [
    ("numpy", signal.SIGINT, 1, 130, "interrupted"),
    ("numpy", signal.SIGINT, 2, 130, "stopped at once"),
    ("numpy", signal.SIGTERM, 1, 143, "terminated"),
    ("matplotlib.ft2font", signal.SIGTERM, 1, 143, "terminated; continue from epoch_0001.pt with trainer.resume=")],
    ids=["ctrl_c_in_torchs_import", "ctrl_c_twice", "sigterm_in_torchs_import", "sigterm_in_the_first_plot"])
def test_a_signal_while_a_native_module_initializes_is_taken_once_it_has_loaded(tmp_path, module, sent, times, status,
                                                                                  said):
    """Ctrl-C inside torch's import of numpy was swallowed there: the run trained on, with
    numpy half made; pressed twice, it ends the process at once, as elsewhere. SIGTERM there
    ended the process without a word. SIGTERM inside matplotlib's ft2font initialization, as
    the first checkpoint's curves were plotted, left objects its static destructor freed
    after Python's finalization: the process aborted at exit ("Fatal Python error:
    PyThreadState_Get"), under load in CI too."""
    argv = command(tmp_path / "run", *SMALL, "trainer.batch_size=32", "trainer.epochs=2")[1:]
    script = SIGNALLED_IMPORT.format(module=module, sent=int(sent), times=times, argv=argv)
    out = subprocess.run([sys.executable, "-c", script],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300, preexec_fn=from_a_terminal)
    printed = out.stdout + out.stderr
    assert out.returncode == status and said in printed, printed
    assert "Traceback" not in printed and "Fatal Python error" not in printed, printed
    assert (tmp_path / "run").exists() == (module != "numpy")  # taken before Hydra made the run's folder


def stopped_sweep(sweep: Path, args: list[str], how: str) -> subprocess.CompletedProcess:
    """The sweep `args` in `sweep`, with its job 1 stopped as it saves its first checkpoint
    (`how`: Ctrl-C before the file is written, or after) or its second (a full disk)."""
    script = f"""
import errno, os, runpy, signal, sys
import torch
from trainer import loop
save, torch_save = loop.Trainer.save, torch.save
def stop_job_1(self, epochs_done):
    if self.run_dir.name == "1" and epochs_done == 1 and {how!r} == "ctrl-c before saving":
        signal.raise_signal(signal.SIGINT)
    save(self, epochs_done)
    if self.run_dir.name == "1" and {how!r} == "ctrl-c after saving":
        signal.raise_signal(signal.SIGINT)
def full_at_job_1s_second(obj, f, *args, **kwargs):
    if {how!r} == "disk full" and "/1/checkpoints/epoch_0002.pt" in str(getattr(f, "name", f)):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    torch_save(obj, f, *args, **kwargs)
loop.Trainer.save, torch.save = stop_job_1, full_at_job_1s_second
sys.argv = {command(sweep, *args, multirun=True)[1:]!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=sweep.parent,
                          timeout=300, preexec_fn=from_a_terminal)


SWEEP = [*SMALL, "trainer.epochs=2", "trainer.seed=1,2,3"]


@pytest.mark.parametrize("how", ["ctrl-c after saving", "disk full"])
def test_a_sweep_stopped_part_way_goes_on_in_its_folder(tmp_path, how):
    """Ctrl-C in a sweep's job said how to continue that job alone, as a run of its own, and
    the sweep's command run again in its folder was refused as "another sweep's jobs": the
    jobs after it could only be started by hand. Now the same command in the same folder
    goes on with each job from its newest checkpoint (a finished one trains nothing) and
    starts those that had not run; another command there is refused, and writes nothing.
    A full disk stops the sweep likewise: the next job went on to Hydra's traceback as it
    wrote its .hydra/."""
    sweep = tmp_path / "sweep"
    out = stopped_sweep(sweep, SWEEP, how)
    assert out.returncode == (130 if how.startswith("ctrl-c") else 2) and "Traceback" not in out.stderr, out.stderr
    said = ("interrupted; to go on, " if how.startswith("ctrl-c") else
            f"cannot write {sweep / '1' / 'checkpoints' / 'epoch_0002.pt'} (No space left on device); the earlier "
            f"checkpoints in {sweep / '1' / 'checkpoints'} are intact; make room there, then ")
    assert out.stdout.splitlines()[-1].endswith(
        f" - {said}run the sweep's command again with hydra.sweep.dir={sweep}: each job goes on from its newest "
        "checkpoint, and the jobs not yet run start (this one from epoch_0001.pt)"), out.stdout
    assert [p.name for p in (sweep / "1" / "checkpoints").iterdir()] == ["epoch_0001.pt"]
    assert not (sweep / "2").exists()
    finished = (sweep / "0" / "summary.json").read_bytes()
    before = {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()}
    other = run(sweep, *SWEEP[:-2], "trainer.epochs=3", SWEEP[-1], multirun=True)
    assert other.returncode == 2 and other.stderr == (
        f"{sweep} holds another sweep's jobs (0/ has its checkpoints or results): give this sweep a folder of its own "
        "(hydra.sweep.dir=...); a sweep goes on in its folder only with the command line it was started with, but "
        "for trainer.stop_after_epoch and the machine's options (data.threads, data.decode_cache, compile_cache, "
        "dist.timeout_s)\n")
    assert {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()} == before
    again = run(sweep, *SWEEP, multirun=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (sweep / "0" / "summary.json").read_bytes() == finished  # nothing left to train
    assert f"resumed from {sweep / '1'}, saved after epoch 1" in (sweep / "1" / "run.log").read_text()
    for job in "12":
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert (summary["epochs"], summary["steps"]) == (2, 16), job


def test_a_sweep_stopped_before_a_jobs_first_checkpoint_says_to_remove_its_folder(tmp_path):
    """That job's records, of an attempt with nothing to continue from, stand in the way of
    its start anew, as a run's do: the sweep says so, and goes on once they are gone."""
    sweep = tmp_path / "sweep"
    out = stopped_sweep(sweep, SWEEP, "ctrl-c before saving")
    assert out.returncode == 130 and out.stdout.splitlines()[-1].endswith(
        f" - interrupted before this job's first checkpoint; remove {sweep / '1'}, then run the sweep's command again "
        f"with hydra.sweep.dir={sweep}: each job goes on from its newest checkpoint, and the jobs not yet run "
        "start"), out.stdout + out.stderr
    refused = run(sweep, *SWEEP, multirun=True)
    assert refused.returncode == 2 and refused.stderr == (
        f"sweep job 1 ({' '.join(SWEEP[:-1])} trainer.seed=2) ended before its first checkpoint (stopped, or "
        f"failed: {sweep / '1' / 'run.log'} says why), and {sweep / '1'} holds its records: remove {sweep / '1'}, then "
        "run the sweep again to start that job anew\n")
    shutil.rmtree(sweep / "1")
    again = run(sweep, *SWEEP, multirun=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((sweep / "1" / "summary.json").read_text())["steps"] == 16


def test_a_sweep_goes_on_with_its_overrides_in_another_order_and_runs_its_other_modes_again(tmp_path):
    """Its command run again lists the same jobs in another order of overrides, or runs a
    plan job again, which writes the same plan: both were refused as another sweep's."""
    sweep = tmp_path / "sweep"
    assert run(sweep, "mode=plan,train", *SMALL, "trainer.epochs=1", multirun=True).returncode == 0
    plan, summary = (sweep / "0" / "plan.json").read_bytes(), (sweep / "1" / "summary.json").read_bytes()
    again = run(sweep, "trainer.epochs=1", *SMALL, "mode=plan,train", multirun=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (sweep / "0" / "plan.json").read_bytes() == plan and (sweep / "1" / "summary.json").read_bytes() == summary


def test_a_sweep_goes_on_with_its_swept_keys_in_another_order(tmp_path):
    """The jobs are numbered by the order of the swept keys: given in another order, each
    job's folder held another job's records, and the same sweep was refused as another's."""
    sweep = tmp_path / "sweep"
    tiny = ["data.train_size=64", "data.val_size=32", "trainer.batch_size=8", "trainer.epochs=1"]
    assert run(sweep, "trainer.seed=1,2", "optimizer=sgd,nesterov", *tiny, multirun=True).returncode == 0
    summaries = {job: (sweep / job / "summary.json").read_bytes() for job in "0123"}
    again = run(sweep, "optimizer=sgd,nesterov", *tiny, "trainer.seed=1,2", multirun=True)
    assert again.returncode == 0 and again.stdout.count("nothing left to train") == 4, again.stdout + again.stderr
    assert {job: (sweep / job / "summary.json").read_bytes() for job in "0123"} == summaries


def test_a_sweep_in_folders_named_by_their_overrides_goes_on(tmp_path):
    """hydra.sweep.subdir=${hydra.job.override_dirname}: run again in its folder, each job's resume composed
    the defaults again with that override resolved to its folder's name, and ended in Hydra's traceback."""
    sweep = tmp_path / "sweep"
    args = ["hydra.sweep.subdir=${hydra.job.override_dirname}", "trainer.seed=1,2", "data.train_size=64",
            "data.val_size=32", "trainer.batch_size=8", "trainer.epochs=1"]
    assert run(sweep, *args, multirun=True).returncode == 0
    again = run(sweep, *args, multirun=True)
    assert again.returncode == 0 and again.stdout.count("nothing left to train") == 2, again.stdout + again.stderr


def test_a_sweep_job_that_stands_failed_is_found_by_its_overrides(tmp_path):
    """Run again with a swept key's values in another order, in folders named by their overrides, a job that
    failed in the earlier attempt stands failed with its own message: its failure was looked up by its job
    number, and another job's was said."""
    sweep = tmp_path / "sweep"
    args = ["hydra.sweep.subdir=${hydra.job.override_dirname}", "data.train_size=64", "data.val_size=32",
            "trainer.batch_size=8", "trainer.epochs=1"]
    first = run(sweep, "optimizer.lr=1e9,0.1,1e4", *args, multirun=True)
    failed = dict(re.findall(r"\njob \d \(optimizer.lr=(\S+) .*?\): (.*)", first.stderr))
    assert first.returncode == 2 and len(set(failed.values())) == 2, first.stderr  # one diverges, one turns NaN
    again = run(sweep, "optimizer.lr=1e4,0.1,1e9", *args, multirun=True)
    assert again.returncode == 2 and again.stderr.startswith("2 of the sweep's 3 jobs failed"), again.stderr
    said = re.findall(r"\njob (\d) \(optimizer.lr=(\S+) .*?\): (.*) \(in the sweep's earlier attempt; ", again.stderr)
    assert said == [("0", "10000.0", failed["10000.0"]), ("2", "1000000000.0", failed["1000000000.0"])], again.stderr


@pytest.mark.parametrize("then, now", [(["trainer.seed=1,2,3"], ["trainer.seed=1,2"]),
                                       (["trainer.seed=1,2", "trainer.epochs=1,2"], ["trainer.seed=1,2", "trainer.epochs=1,2,3"])])
def test_a_sweep_run_again_with_other_swept_values_says_what_changed(tmp_path, then, now):
    """A value removed, or one added that numbers the jobs anew, leaves a job's folder to a job the sweep no
    longer has or to another: the same sweep with a changed command line was refused as another sweep's."""
    sweep = tmp_path / "sweep"
    assert run(sweep, "mode=plan", *then, multirun=True).returncode == 0
    before = {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()}
    out = run(sweep, "mode=plan", *now, multirun=True)
    changed = [(a, b) for a, b in zip(then, now) if a != b]
    assert out.returncode == 2 and out.stderr == (
        f"{sweep} holds this sweep's jobs as its earlier attempt swept {' '.join(a for a, _ in changed)}, where this "
        f"command sweeps {' '.join(b for _, b in changed)}: run it with the earlier values, or give this sweep a folder "
        "of its own (hydra.sweep.dir=...)\n"), out.stderr
    assert {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()} == before


def test_a_sweep_stopped_by_stop_after_epoch_goes_on_with_a_later_stop_or_none(tmp_path):
    """trainer.stop_after_epoch stops every job of a sweep as a preemption would; the sweep
    run again without it (or with a later epoch), as the jobs' refusal of the same stop
    advised, was refused as another sweep's, and with the same stop each job failed. The
    machine's options may differ too."""
    sweep = tmp_path / "sweep"
    args = [*SMALL, "trainer.epochs=3", "trainer.seed=1,2"]
    assert run(sweep, *args, "trainer.stop_after_epoch=1", multirun=True).returncode == 0
    same = run(sweep, *args, "trainer.stop_after_epoch=1", multirun=True)  # its jobs stopped where it stops them
    assert same.returncode == 0 and "stops it: nothing left to train" in same.stdout, same.stdout + same.stderr
    later = run(sweep, *args, "trainer.stop_after_epoch=2", "data.threads=1", multirun=True)
    assert later.returncode == 0, later.stdout + later.stderr
    assert run(sweep, *args, multirun=True).returncode == 0
    for job in "01":
        assert json.loads((sweep / job / "summary.json").read_text())["epochs"] == 3
    assert sorted(p.name for p in (sweep / "0" / "checkpoints").iterdir()) == ["epoch_0002.pt", "epoch_0003.pt"]


def test_a_sweep_in_a_folder_given_under_home_goes_on_there(tmp_path):
    """hydra.sweep.dir='~/sweep': its jobs' folders were checked as ~/sweep/N in the current
    folder, so the same command run again took the jobs it found in the home folder's for
    another sweep's, and refused to go on."""
    args = ["-m", "hydra.sweep.dir='~/sweep'", *SMALL, "trainer.epochs=1", "trainer.seed=1,2"]
    home = {"HOME": str(tmp_path)}
    assert run_py(args, tmp_path, home).returncode == 0
    summary = (tmp_path / "sweep" / "1" / "summary.json").read_bytes()
    again = run_py(args, tmp_path, home)
    assert again.returncode == 0 and "nothing left to train" in again.stdout, again.stdout + again.stderr
    assert (tmp_path / "sweep" / "1" / "summary.json").read_bytes() == summary and not (tmp_path / "~").exists()


def test_a_sweep_kept_without_its_jobs_overrides_says_how_to_go_on(tmp_path):
    """Under hydra.output_subdir=null its jobs' folders keep no overrides.yaml to match them
    by; the refusal called them another sweep's."""
    sweep, args = tmp_path / "sweep", [*SMALL, "trainer.epochs=1", "trainer.seed=1,2", "hydra.output_subdir=null"]
    assert run(sweep, *args, multirun=True).returncode == 0
    out = run(sweep, *args, multirun=True)
    assert out.returncode == 2 and out.stderr == (
        f"{sweep} holds a sweep's jobs, and under hydra.output_subdir=null their folders keep no record of their "
        "overrides to go on by: give this sweep a folder of its own (hydra.sweep.dir=...), or continue a job's run "
        f"alone (trainer.resume={sweep / '0'})\n")


def test_a_sweep_under_chdir_records_its_jobs_in_its_own_folder(tmp_path):
    """hydra.job.chdir=true runs each job in its folder, where the sweep's relative folder
    named another: jobs.jsonl was never written (a warning a job), so a failed job went
    uncounted, and the advice to go on named a folder inside the job's."""
    out = run_py(["-m", "hydra.sweep.dir=sweep", "hydra.job.chdir=true", "optimizer.lr=1e9,0.1", *SMALL,
                  "trainer.epochs=1"], tmp_path)
    assert out.returncode == 2 and "warning" not in out.stderr, out.stderr
    assert out.stderr.startswith("1 of the sweep's 2 jobs failed"), out.stderr
    assert len((tmp_path / "sweep" / "jobs.jsonl").read_text().splitlines()) == 2


def test_a_file_where_a_sweep_job_would_run_is_refused_before_any_job_runs(tmp_path):
    """Hydra's launcher ended in its traceback at that job, after the jobs before it had run."""
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "1").write_text("")
    out = run(tmp_path / "sweep", "mode=plan", "trainer.seed=1,2", multirun=True)
    assert out.returncode == 2 and out.stderr == (
        f"sweep job 1 (mode=plan trainer.seed=2) runs in {tmp_path / 'sweep' / '1'}, which is a file: move it, or give "
        "the sweep a folder of its own (hydra.sweep.dir=...)\n"), out.stderr
    assert not (tmp_path / "sweep" / "0").exists()


def test_shell_completion_is_hydras(tmp_path):
    """-sc install=bash was read as an override: "install: the configuration has no such key"."""
    out = run_py(["-sc", "install=bash"], tmp_path)
    assert out.returncode == 0 and "hydra_bash_completion" in out.stdout, out.stdout + out.stderr


def test_a_run_whose_data_set_moved_resumes_and_evaluates_given_data_root_alone(tmp_path):
    """The data options come from the checkpoint: data.root=NEW alone was refused against the
    defaults' data=synthetic before they were taken, and the advice it gave (data=imagefolder)
    chose that group's resolution and classes over the run's. Evaluation needs the val split
    alone."""
    from trainer.data.make_jpeg_tree import main as make_jpeg_tree
    make_jpeg_tree([str(tmp_path / "before"), "--classes", "2", "--per-class", "8", "--val-per-class", "2",
                    "--size", "24x20", "--jobs", "1"])
    data = ["data=imagefolder", "data.num_classes=2", "data.resolution=16", "trainer.batch_size=4"]
    first = run(tmp_path / "run", *data, f"data.root={tmp_path / 'before'}", "trainer.epochs=2",
                "trainer.stop_after_epoch=1")
    assert first.returncode == 0, first.stderr
    (tmp_path / "before").rename(tmp_path / "after")
    resumed = run(tmp_path / "run", f"trainer.resume={tmp_path / 'run'}", f"data.root={tmp_path / 'after'}")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["epochs"] == 2
    # evaluation reads the val split alone: the training split may be gone
    shutil.rmtree(tmp_path / "after" / "train")
    evaluated = run(tmp_path / "eval", "mode=eval", f"checkpoint={tmp_path / 'run'}", f"data.root={tmp_path / 'after'}")
    assert evaluated.returncode == 0, evaluated.stderr
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    trained = json.loads((tmp_path / "run" / "summary.json").read_text())
    # on a GPU another process may take other cuDNN algorithms, which round otherwise
    assert summary["val_top1"] == trained["val_top1"]
    assert summary["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-4)
    # the file it read, not its run's folder, where a resumed run writes newer ones
    assert summary["checkpoint"] == str(tmp_path / "run" / "checkpoints" / "epoch_0002.pt")
    assert f"evaluating {summary['checkpoint']}" in evaluated.stdout + evaluated.stderr
    # export reads no image: the checkpoint's data.root, gone, is not looked at
    exported = run(tmp_path / "export", "mode=export", f"checkpoint={tmp_path / 'run'}")
    assert exported.returncode == 0 and (tmp_path / "export" / "model_state_dict.pt").exists(), exported.stderr


def test_a_run_whose_last_evaluation_met_a_damaged_image_says_how_to_go_on_and_does_it(tmp_path):
    """An image damaged in its middle passes the set-up's check and fails the evaluation:
    the epoch was saved, but the message said only what was damaged, and a resume once it
    was removed found nothing left to train, its summary without an evaluation for good."""
    from trainer.data.make_jpeg_tree import main as make_jpeg_tree
    make_jpeg_tree([str(tmp_path / "data"), "--classes", "2", "--per-class", "8", "--val-per-class", "2",
                    "--size", "24x20", "--jobs", "1"])
    damaged = sorted((tmp_path / "data" / "val").rglob("*.jpg"))[0]
    data = bytearray(damaged.read_bytes())
    data[300:-10] = b"\xab" * len(data[300:-10])
    damaged.write_bytes(bytes(data))
    options = ["data=imagefolder", "data.num_classes=2", "data.resolution=16", "trainer.batch_size=4",
               f"data.root={tmp_path / 'data'}", "trainer.epochs=1"]
    failed = run(tmp_path / "run", *options)
    assert failed.returncode == 2
    assert re.search(r"corrupt JPEG .*: cannot be decoded .*; once that is mended, continue from epoch_0001.pt with "
                     rf"trainer.resume={tmp_path / 'run'} \(which takes this run's options from it\)", failed.stdout)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["val_top1"] is None
    damaged.unlink()
    resumed = run(tmp_path / "run", f"trainer.resume={tmp_path / 'run'}")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["val_top1"] is not None and summary["val_epoch"] == 1


def test_a_sweep_job_sent_into_another_runs_folder_is_refused_before_any_job_runs(tmp_path):
    """hydra.sweep.subdir=. sends the job into the sweep's folder itself: the job was refused
    only after Hydra had written its .hydra/ over that run's record of its command line."""
    assert run(tmp_path / "run", *SMALL, "trainer.epochs=1").returncode == 0
    recorded = (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()
    out = run(tmp_path / "run", "trainer.epochs=2", "hydra.sweep.subdir=.", multirun=True)
    assert out.returncode == 2 and f"{tmp_path / 'run'} holds another run's checkpoints" in out.stderr, out.stderr
    assert (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text() == recorded
    assert not (tmp_path / "run" / "multirun.yaml").exists()


def test_a_sweep_jobs_value_of_the_wrong_type_says_why(tmp_path):
    """In one line, before Hydra writes the sweep's folder."""
    out = run(tmp_path / "sweep", "trainer.epochs=1,abc", multirun=True)
    assert (out.returncode, out.stderr) == (2, "trainer.epochs=1,abc: Value 'abc' of type 'str' could not be "
                                               "converted to Float\n")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("sweep, said", [
    ("optimizer.lr=interval(0,1)", "optimizer.lr=interval(0,1): Hydra's basic sweeper runs lists (a,b,c), range() and "
                                   "choice(); interval() is for a sweeper that samples (a hydra/sweeper plugin such as "
                                   "optuna)"),
    ("optimizer=glob(zz*)", "optimizer=glob(zz*) sweeps over no value: the sweep would have no jobs; give it one or more"),
    ("trainer.seed=range(0)", "trainer.seed=range(0) sweeps over no value: the sweep would have no jobs; give it one or "
                              "more"),
    ("trainer.seed=1,2 mode=plan trainer.seed=3", "trainer.seed is given twice (trainer.seed=1,2 and trainer.seed=3): "
                                                  "the sweep would run the later's values alone; give it once, with "
                                                  "every value to sweep")])
def test_a_sweep_the_basic_sweeper_cannot_run_is_one_line(tmp_path, sweep, said):
    """interval() ended in the sweeper's traceback, and a sweep of no jobs in exit 0 with a
    folder holding only multirun.yaml. A key swept and given again ran one job, the later
    value's, without a word."""
    out = run(tmp_path / "sweep", *sweep.split(), multirun=True)
    assert (out.returncode, out.stderr) == (2, said + "\n")
    assert not (tmp_path / "sweep").exists()


def test_a_second_run_in_a_folder_in_use_is_refused_before_it_writes_there(tmp_path):
    """A resume of a run that has not ended (a requeued job beside the one still stopping)
    passed the folder checks and trained into it beside the first: two records of an epoch,
    and each one's checkpoints over the other's."""
    with started(command(tmp_path / "run", "trainer.epochs=1000"), cwd=tmp_path, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT) as first:
        printed = ""
        while "epoch 2 step" not in printed:  # after the first checkpoint, which the resume reads
            line = first.stdout.readline()
            assert line, printed
            printed += line
        second = run(tmp_path / "run", f"trainer.resume={tmp_path / 'run'}")
        assert first.poll() is None, printed
        first.kill()
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"{tmp_path / 'run'} is in use by another run that has not ended" in second.stderr, second.stderr
    assert not list((tmp_path / "run" / ".hydra").glob("resumed_*"))


def test_a_relative_path_is_read_from_the_folder_the_command_started_in_by_a_sweeps_jobs_too(tmp_path):
    """Under hydra.job.chdir=true a sweep's job runs in its own folder, where checkpoint=run
    named nothing; a single run read it from the folder the command was started in."""
    assert run(tmp_path / "run", *SMALL, "trainer.epochs=1").returncode == 0
    out = run(tmp_path / "sweep", "mode=eval", "checkpoint=run", "hydra.job.chdir=true", "data.tta=0,1", multirun=True,
              cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    for job in ("0", "1"):
        summary = json.loads((tmp_path / "sweep" / job / "summary.json").read_text())
        assert summary["checkpoint"] == str(tmp_path / "run" / "checkpoints" / "epoch_0001.pt")


def interrupted_once_it_says(args: list[str], cwd: Path, said: str) -> tuple[int, str]:
    """The command, sent Ctrl-C once it prints `said`: its exit status and all it printed."""
    with started(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        printed = ""
        while said not in printed:
            line = proc.stdout.readline()
            assert line, printed
            printed += line
        proc.send_signal(signal.SIGINT)
        printed += proc.communicate(timeout=60)[0]
    return proc.returncode, printed


def test_a_run_in_a_folder_it_was_given_interrupted_before_its_first_checkpoint_is_told_to_remove_it(tmp_path):
    """It was told there was nothing to continue from, and the same command was then refused
    for the records it had left in its folder."""
    status, printed = interrupted_once_it_says(command(tmp_path / "run", "trainer.log_every=1"), tmp_path, "epoch 1 step")
    assert status == 130 and printed.rstrip().endswith(
        f"interrupted before its first checkpoint: {tmp_path / 'run'} holds nothing to continue from; remove it and "
        "run the same command again"), printed


def test_an_interrupted_branch_is_told_how_to_start_it_again(tmp_path):
    """A branch (a resume from an older checkpoint into a folder of its own) stopped before its
    first checkpoint was told to resume the checkpoint again, which is refused in its run's
    folder (not its newest) and in the branch's (its records), and dropped its options."""
    assert run(tmp_path / "run", "trainer.epochs=3", "trainer.stop_after_epoch=2").returncode == 0
    branch = [f"trainer.resume={tmp_path / 'run' / 'checkpoints' / 'epoch_0001.pt'}", "trainer.epochs=3",
              "trainer.checkpoint_every=0"]
    printed = interrupted_once_it_says(command(tmp_path / "branch", *branch), tmp_path, "epoch 2 step")[1]
    assert (f"interrupted before its first checkpoint: {tmp_path / 'branch'} holds nothing to continue from; remove it "
            "and run the same command again") in printed, printed
    shutil.rmtree(tmp_path / "branch")
    again = run(tmp_path / "branch", *branch, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((tmp_path / "branch" / "summary.json").read_text())["epochs"] == 3


def test_a_sweep_of_resumes_checks_every_job_with_its_checkpoints_options_first(tmp_path):
    """A sweep's jobs are checked before the first runs, those that read a checkpoint with the
    options they take from it: one with a bad value was found only after the jobs before it."""
    assert run(tmp_path / "run", *SMALL, "trainer.epochs=2", "trainer.stop_after_epoch=1").returncode == 0
    out = run(tmp_path / "sweep", f"trainer.resume={tmp_path / 'run'}", "optimizer.lr=0.1,-1", multirun=True)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().endswith("optimizer.lr=-1.0 must not be negative; no job has run"), out.stderr
    assert not (tmp_path / "sweep" / "0").exists()


@pytest.mark.parametrize("path", ["/runs/a", "/runs/lr=0.1,bs=64", "/runs/a b", "/runs/it's", '/runs/q"uote',
                                  "/runs/back\\", "/runs/[a]{b}(c):d"])
def test_the_advice_to_continue_is_a_command_line_word_that_gives_the_path(path):
    """The advice printed trainer.resume=/runs/lr=0.1,bs=64, which the shell passes on as it
    is and Hydra's grammar then refuses (a comma makes a sweep); quoted for both, it gives
    back the path."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from trainer.run_dir import continue_with
    words = shlex.split(continue_with(Path(path), 1))
    assert len(words) == 1 and OverridesParser.create().parse_override(words[0]).value() == path


def test_a_message_naming_a_file_whose_name_is_not_utf8_is_logged(tmp_path):
    """The log's console and file refused the name's surrogates: logging's traceback took the
    message's place, and run.log stayed empty."""
    from PIL import Image
    for split, classes in (("train", [b"a", b"b"]), ("val", [b"a", b"\xe9t\xe9"])):
        for name in classes:
            folder = os.path.join(os.fsencode(tmp_path / "data" / split), name)
            os.makedirs(folder)
            for image in (b"0.jpg", b"1.jpg"):
                Image.new("RGB", (20, 20)).save(os.fsdecode(os.path.join(folder, image)))
    out = run(tmp_path / "run", "data=imagefolder", f"data.root={tmp_path / 'data'}", "data.num_classes=2",
              "data.resolution=16", "trainer.batch_size=2")
    said = "differ in their class folders (b, \\udce9t\\udce9)"
    assert out.returncode == 2 and said in out.stdout and "Logging error" not in out.stderr, out.stdout + out.stderr
    assert said in (tmp_path / "run" / "run.log").read_text()


def test_an_error_in_the_checks_before_a_run_ends_it_there_with_one_line(tmp_path):
    """Hydra turns what a callback raises into a warning and starts the job anyway: an
    interpolation that resolves to nothing, met in the checks made before the run's folder,
    gave OmegaConf's five-line message as a warning, a folder for a run that then failed,
    and the checks were skipped."""
    out = run_py(["trainer.resume=${nope}"], tmp_path)
    assert (out.returncode, out.stderr) == (2, "trainer.resume: Interpolation key 'nope' not found\n"), out.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_sweep_is_checked_with_the_interpolations_its_command_line_gives(tmp_path):
    """Its overrides were read resolved against Hydra's own node, where ${trainer.seed} is not:
    the check of every job before the first was skipped with a warning, and job 0 ran before
    job 1 was refused (trainer.epochs=0)."""
    out = run(tmp_path / "sweep", "mode=plan", "trainer.epochs=${trainer.seed}", "trainer.seed=1,0", multirun=True)
    assert out.returncode == 2 and "UserWarning" not in out.stderr, out.stderr
    # the job's overrides as given, not as the sweeper escapes them ($\{trainer.seed\})
    assert "sweep job 1 (mode=plan trainer.epochs=${trainer.seed} trainer.seed=0): " in out.stderr, out.stderr
    assert "no job has run" in out.stderr
    assert not (tmp_path / "sweep" / "0").exists()


def test_a_sweeps_params_from_its_config_are_checked_resolved_as_the_sweeper_reads_them(tmp_path):
    """Hydra resolves hydra.sweeper.params as it makes the sweeper: read unresolved, the
    check refused the jobs it would have run (seed '${oc.env:SEEDS}' is not an integer)."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "seeds.yaml").write_text("defaults: [train, _self_]\nhydra:\n  sweeper:\n    params:\n"
                                                  "      trainer.seed: ${oc.env:SEEDS}\n")
    out = run_py(["-m", "--config-dir", str(tmp_path / "conf"), "--config-name", "seeds",
                  f"hydra.sweep.dir={tmp_path / 'sweep'}", "mode=plan"], tmp_path, env={"SEEDS": "1,2"})
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1"]


def test_a_run_in_the_tests_process_reports_what_its_own_process_would(tmp_path, monkeypatch):
    """tests/helpers.py's run_py, which most command-line tests here use: an error that
    escapes the run is its traceback on stderr and exit status 1, as in a process of its
    own; C extensions' writes are in its output; and the test's process is left as it was."""
    from trainer import app

    def fails(cfg):
        print("printed")
        os.write(2, b"written to file descriptor 2\n")
        raise RuntimeError("an error no handler takes")
    monkeypatch.setattr(app, "main", fails)
    here, sigint, argv = os.getcwd(), signal.getsignal(signal.SIGINT), sys.argv
    out = run_py([f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert out.returncode == 1 and "Traceback" in out.stderr, out.stderr
    assert "RuntimeError: an error no handler takes" in out.stderr and "written to file descriptor 2" in out.stderr
    assert out.stdout == "printed\n"
    assert (os.getcwd(), signal.getsignal(signal.SIGINT), sys.argv) == (here, sigint, argv)
