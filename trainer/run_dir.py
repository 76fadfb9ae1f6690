"""Whose a run folder is. A training run must not write into another run's folder:
hydra.run.dir and torchrun's --rdzv_id may be given again (a timestamped folder is made
new for each run, trainer.app._new_folder). The run whose checkpoints and
records a folder holds continues in it: resumed from them, or restarted by torchrun's
agent, which started before this job wrote anything there. No torch here: the Hydra
callback that checks the folder runs before the configuration is read.
"""
import contextlib
import os
import re
import shlex
import zipfile
from pathlib import Path

from omegaconf import ListConfig, OmegaConf

from trainer.errors import CheckpointError, ConfigError, WriteError

RECORDS = "metrics.jsonl"
# what a run of each mode writes beside its log and .hydra/: training (metrics, plan, summary,
# curves), evaluation (summary), export (weights), plan and bench
RESULTS = (RECORDS, "summary.json", "plan.json", "curves.png", "model_state_dict.pt", "bench.md")
CHECKPOINT_NAME = re.compile(r"epoch_(\d+)\.pt")


def saved(folder: Path) -> list[Path]:
    """The checkpoints in a folder, oldest first, by their epoch's number. Only the names the
    trainer writes: a copy a user keeps beside them (epoch_0003_good.pt) is neither the
    newest nor one to prune."""
    found = (p for p in Path(folder).glob("epoch_*.pt") if CHECKPOINT_NAME.fullmatch(p.name))
    return sorted(found, key=lambda p: int(CHECKPOINT_NAME.fullmatch(p.name)[1]))


def find_checkpoint(path) -> Path:
    """The checkpoint a path names: the file, or the newest of a run folder or of its
    checkpoints/ folder."""
    path = Path(path)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = saved(folder)
        if not found:  # a sweep's folder, or one of runs: the runs in it
            runs = sorted(str(p) for p in folder.iterdir() if saved(p / "checkpoints"))
            raise CheckpointError(f"no checkpoints (epoch_N.pt) in {folder}: " + (
                f"give one of the runs in it ({', '.join(runs[:3])}{', ...' if runs[3:] else ''})" if runs else
                "give a run's folder that holds them, or a checkpoint file"))
        if found[-1].is_dir():  # else read as the folder it names, "no checkpoints in .../epoch_0003.pt"
            raise CheckpointError(f"{found[-1]} is a folder, not a checkpoint: move it out of {folder}")
        return found[-1]
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: give a checkpoint file, or a run directory that holds them")
    # torch.save writes a zip archive: another of a run's files (plan.json, run.log) was taken
    # for a damaged checkpoint, or for one older than the run's newest
    if not CHECKPOINT_NAME.fullmatch(path.name) and not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a checkpoint written by this trainer: give one of a run's "
                              "checkpoints/epoch_N.pt, or its folder"
                              + (f" ({path.parent})" if saved(path.parent / "checkpoints") else ""))
    return path


PARTS: set[Path] = set()  # what written_whole is writing now, for an exit at once to remove


@contextlib.contextmanager
def written_whole(path: Path):
    """A path to write `path`'s new content to, renamed over it once written: a run stopped
    part way (Ctrl-C, a full disk) leaves the previous file whole, and readers (a resume, two
    runs sharing a cache) never see half of one. An error removes the part written, and so
    does an exit that skips this (a second Ctrl-C, trainer.signals.exit_at_once), from PARTS."""
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    PARTS.add(part)
    try:
        yield part
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
        PARTS.discard(part)


@contextlib.contextmanager
def writing(path: Path, advice: str = ""):
    """A binary file for `path`'s new content, written whole (written_whole) or, where a write
    fails (a full disk, a folder made read-only), not at all, with one message naming the
    file and, after it, `advice` (the app adds how to go on). torch.save given the file, not
    its path, reports a full disk as the file's OSError, where its own writer says
    "unexpected pos 576 vs 534"; or raises that, with the file's error as its context."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with written_whole(path) as part, open(part, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename is: after a power loss, the old file or the new
    except (OSError, RuntimeError) as e:
        failed = e if isinstance(e, OSError) else e.__context__
        if isinstance(failed, BaseException) and not isinstance(failed, Exception):
            raise failed from None  # Ctrl-C or SIGTERM mid-write, over which torch's writer, closing, raised its own
        if not isinstance(failed, OSError):
            raise
        raise WriteError(f"cannot write {path} ({failed.strerror or failed}){advice}", failed.errno) from None


def agent_started_at() -> float | None:
    """When this process's parent (torchrun's agent, which outlives the job's restarts)
    started, in seconds since the epoch; None where Linux's /proc does not say."""
    try:
        ticks = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def restarted(run_dir: Path) -> bool:
    """Whether torchrun's agent started this worker again in a job that has written its records
    in run_dir. Not TORCHELASTIC_RESTART_COUNT > 0: an agent counts the restarts that its own
    workers' failures cause, and one that restarts its workers because another node's failed
    (a change of the rendezvous' members) leaves the count at 0 on its node."""
    records = Path(run_dir) / RECORDS
    return launched() and records.exists() and _this_jobs(records)


def swept() -> bool:
    """Whether this process runs a job of a Hydra sweep (-m)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def launched(env=os.environ) -> bool:
    """Started by torchrun (or another launcher that sets the env:// rendezvous)."""
    return "WORLD_SIZE" in env and "MASTER_ADDR" in env


def ranks(env=os.environ) -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) of a launched process, (0, 1, 0) of any other whatever
    its environment holds: a stray WORLD_SIZE=2 trained a single process on half the data,
    and RANK=1 on none."""
    if not launched(env):
        return 0, 1, 0

    def wrong(shown: str) -> ConfigError:
        return ConfigError(f"{shown} in the environment, with WORLD_SIZE and MASTER_ADDR there: torchrun sets them; "
                           "start the job with torchrun, or unset them for a single process")
    values = []
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        text = env.get(key, "0" if key == "LOCAL_RANK" else "")
        if not text.isdigit() or (key == "WORLD_SIZE" and int(text) == 0):
            raise wrong(f"{key}={text!r}")
        values.append(int(text))
    port = env.get("MASTER_PORT")
    if not (port or "").isdigit():  # else torch's rendezvous ended in its traceback
        raise wrong("MASTER_PORT is not set" if port is None else f"MASTER_PORT={port!r}")
    return tuple(values)


def _this_jobs(path: Path) -> bool:
    """Written since this job's agent started: by an earlier attempt of this job."""
    started = agent_started_at()
    return started is not None and path.stat().st_mtime >= started


def restart_checkpoint(run_dir: Path) -> str:
    """After torchrun restarted the job: the run folder, whose newest checkpoint the job
    continues from, if this job wrote one there; else ''."""
    found = saved(Path(run_dir) / "checkpoints") if launched() else []
    return str(run_dir) if found and _this_jobs(found[-1]) else ""


def continue_with(run_dir: Path, world: int, options: tuple[str, ...] = ()) -> str:
    """How a run of `world` processes goes on from its folder's newest checkpoint, with the
    overrides `options` beside trainer.resume: under torchrun, with as many (with another
    number each BatchNorm normalizes over shares of another size, which a resume says, and a
    sharded optimizer state is refused)."""
    return " ".join([override("trainer.resume", run_dir), *options]) + (
        f", under torchrun with {world} processes as this job" if world > 1 else "")


def processes(world: int) -> str:
    """How a run of `world` processes is started, as a resume's advice names it."""
    return f"{world} processes under torchrun" if world > 1 else "one process (without torchrun)"


def override(key: str, value, shell: bool = True) -> str:
    """key=value as Hydra takes it from a command line (`shell`: as a shell's gives it): a value
    with more than letters, digits and ./_-~+@% (a comma, an =, brackets, quotes, spaces)
    quoted for Hydra's grammar, and that for the shell."""
    value = str(value)
    if re.fullmatch(r"[\w./~+@%-]+", value):
        return f"{key}={value}"
    return shlex.quote(f"{key}={_hydra_quoted(value)}") if shell else f"{key}={_hydra_quoted(value)}"


def _hydra_quoted(value: str) -> str:
    """value as a quoted string of Hydra's override grammar, where backslashes are escaped
    only before a quote or at the end."""
    return '"' + re.sub(r'(\\*)("|$)', lambda m: m[1] * 2 + ('\\"' if m[2] else ""), value) + '"'


def run_folder(checkpoint: str) -> Path:
    """The run folder of a checkpoint path: a file in checkpoints/, that folder, or the run's."""
    path = Path(checkpoint)
    folder = path if path.is_dir() else path.parent
    return (folder.parent if folder.name == "checkpoints" else folder).resolve()


def as_written(overrides) -> list[str]:
    """A command line's overrides as written: Hydra's list of them resolves each as it is read,
    hydra.sweep.subdir=${hydra.job.id} (no value outside a job), trainer.epochs=${data.foo}
    (none at all, which validation names by its key)."""
    return OmegaConf.to_container(overrides) if isinstance(overrides, ListConfig) else list(overrides)


def given(overrides) -> dict[str, str]:
    """The keys a command line's overrides give (key=value, +key=value, ~key) and their values,
    as written."""
    return {key.lstrip("+~"): value for key, _, value in (o.partition("=") for o in as_written(overrides))}


def resumed_folder(resume: str) -> Path | None:
    """The run folder that `resume` names a checkpoint of, where the resumed run goes on
    by default; None for a checkpoint outside any run's folder."""
    folder = run_folder(resume)
    return folder if (folder / "checkpoints").is_dir() else None


def other_run(run_dir: Path, resume: str) -> str | None:
    """Why a run resuming from `resume` ('' for a new one, or a mode other than training) may
    not write into run_dir, or None: the folder holds the checkpoints or results of another
    run, which it would write its own over."""
    run_dir = Path(run_dir)
    found = saved(run_dir / "checkpoints")
    written = [name for name in RESULTS if (run_dir / name).exists()]
    if not (found or written):
        return None
    if resume and run_folder(resume) == run_dir.resolve():  # the run continues in its own folder
        if found and Path(resume).is_file() and Path(resume).resolve() != found[-1].resolve():
            return (f"{resume} is not its run's newest checkpoint ({found[-1].name} is): training on from it in "
                    f"{run_dir} would write over the newer ones; give this branch a folder of its own "
                    f"(hydra.run.dir=...), or continue from the newest with {override('trainer.resume', run_dir)}")
        return None
    if not found and restarted(run_dir):
        return None  # torchrun restarted this job before its first checkpoint
    if found:
        return (f"{run_dir} holds another run's checkpoints ({found[-1].name}): continue that run with "
                f"{override('trainer.resume', run_dir)}, or give this one a folder of its own (hydra.run.dir=...)")
    return (f"{run_dir} holds another run's results ({', '.join(written)}), and no checkpoint to continue from: "
            "give this run a folder of its own (hydra.run.dir=...), or remove them to start over there")
