"""The Hydra application: validate the configuration, then run the requested mode."""
import copy
import dataclasses
import errno
import fcntl
import functools
import itertools
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from trainer.config import (CHECKPOINT_OPTIONS, GOING_ON, INITIAL_VALUES, RUN_OPTIONS, TrainConfig, chosen_keys,
                            expand_paths, first_line, given_changes, given_options, ignored, read_by, recorded,
                            replaced_by_checkpoint, take_options, unread_by_mode, unread_in, validate)
from trainer.errors import CheckpointError, ConfigError, DataError, PeerError, TrainerError, WriteError
from trainer.run_dir import (as_written, continue_with, find_checkpoint, given, launched, other_run, override, ranks,
                             restart_checkpoint, restarted, resumed_folder, saved, swept, writing)
from trainer.signals import STOPPING, exit_at_once

log = logging.getLogger("trainer")


def run_plan(cfg: TrainConfig, run_dir: Path):
    from trainer.dist import from_env
    from trainer.report import region_table
    from trainer.setup import make_plans
    plans = make_plans(cfg, cfg.dist.plan_ranks or from_env().world)[1]
    if _is_main():
        # dist.shard_optimizer=true planned for one rank is planned unsharded; optimizer.lr is planned by none
        for why in [*unread_by_mode(cfg, given(HydraConfig.get().overrides.task)), *ignored(cfg)]:
            log.warning("%s", why)
        print(region_table(plans))
        _write_plan(plans, run_dir)
        log.info("wrote %s", run_dir / "plan.json")


def run_train(cfg: TrainConfig, run_dir: Path):
    from trainer import dist
    from trainer.loop import Trainer
    trainer = Trainer(cfg, run_dir, dist.start(cfg))
    if trainer.dist.is_main and not trainer.finished:  # a resume that trains nothing keeps the run's own plan
        _write_plan(trainer.plans, run_dir)
    summary = trainer.fit()
    log.info("summary: %s", json.dumps(summary))


def _write_plan(plans, run_dir: Path):
    with writing(run_dir / "plan.json") as f:
        f.write(json.dumps(plans.to_json(), indent=1).encode())


def _configured(dict_cfg: DictConfig, run_dir: Path, hydra: DictConfig, task, say: bool = True) -> TrainConfig:
    """The validated configuration of a run whose command line gives the overrides `task`
    (`hydra`: Hydra's node of the run, or of its sweep, for the configuration's name and
    Hydra's own overrides, which compose the defaults the command line is compared with). A
    resume (or torchrun's restart of the job) takes the options of the run it continues, an
    evaluation or export the model's and the data's of the run that wrote its checkpoint,
    where the command line does not give them, before the checks: given alone,
    data.root=NEW (the data set moved) was refused against the defaults' data=synthetic.
    `say`: log what it takes (not while a sweep checks its jobs before the first)."""
    from trainer import checkpoint
    try:
        cfg = expand_paths(OmegaConf.to_object(_read_by_mode(dict_cfg, hydra, task)))
    except OmegaConfBaseException as e:
        raise _unresolved(e) from None
    meta, changed = {}, {}  # of the checkpoint read: its meta, and the options given otherwise than its run's
    if cfg.mode == "train":
        cfg.trainer.resume = restart_checkpoint(run_dir) or _sweep_checkpoint(run_dir, hydra) or cfg.trainer.resume
        if cfg.trainer.resume:
            meta, changed = _take_options(cfg, cfg.trainer.resume, RUN_OPTIONS, hydra, task, say)
    elif cfg.mode in ("eval", "export"):
        if not (cfg.checkpoint or cfg.trainer.resume):
            raise CheckpointError(f"mode={cfg.mode} needs checkpoint=PATH (a checkpoint file or a run directory)")
        if cfg.checkpoint and cfg.trainer.resume and not _one_checkpoint(cfg.checkpoint, cfg.trainer.resume):
            raise ConfigError(f"checkpoint={cfg.checkpoint} and trainer.resume={cfg.trainer.resume} name two "
                              f"checkpoints, and mode={cfg.mode} reads one: give checkpoint= alone")
        # the file, not its run's folder, where a resumed run writes newer ones: what it read is recorded
        cfg.trainer.resume = str(find_checkpoint(cfg.checkpoint or cfg.trainer.resume))
        meta, changed = _take_options(cfg, cfg.trainer.resume, CHECKPOINT_OPTIONS, hydra, task, say)
        # model=resnet18 (or ema=true) given for a fastnet's: refused before the run's folder is made
        checkpoint.check_model_options(Path(cfg.trainer.resume), meta, checkpoint.identity(cfg))
    validate(cfg)
    if cfg.mode in ("eval", "export"):
        # planned with the checkpoint's optimizer: one written before checkpoints kept their model's fingerprint is
        # restored whole, its optimizer's state too (checkpoint.load); set once validated, as the optimizer's other
        # options, which neither mode reads, are composed for another (app._read_by_mode)
        cfg.optimizer.name = meta["optimizer"]
    if changed:  # once validated: a model of a depth validate refuses would fail to build, in torch's words
        checkpoint.check_model_tensors(Path(cfg.trainer.resume), meta, cfg, changed, evaluating=cfg.mode != "train")
    return cfg


def _read_by_mode(dict_cfg: DictConfig, hydra: DictConfig, task) -> DictConfig:
    """dict_cfg, composed again without the overrides `task` gives that its mode does not read
    (config.unread_in: optimizer=lars evaluating, data=cifar10 exporting), where it gives any:
    neither what their groups set that the mode reads (data=imagefolder's 1000 classes, in
    an export of a 10 classes' checkpoint) nor a value of theirs that the checks refuse
    (data=cifar10 without data.root) has any effect then. _take_options says them. mode=plan and
    mode=bench, which read no checkpoint, are composed with them: they check a training
    configuration, refusing what training would (optimizer.lr=nan), and say them (run_plan)."""
    written = as_written(task)
    read = [o for o in written if not unread_in(dict_cfg.mode, o.partition("=")[0].lstrip("+~"))]
    if len(read) == len(written) or dict_cfg.mode in ("plan", "bench"):
        return dict_cfg
    composed = GlobalHydra.instance().config_loader().load_configuration(
        hydra.job.config_name, [*_hydras_overrides(hydra), *read], RunMode.RUN)
    with open_dict(composed):
        del composed["hydra"]
    return composed


def _hydras_overrides(hydra: DictConfig) -> list[str]:
    """Hydra's own overrides as given: read item by item, hydra.sweep.subdir=${hydra.job.override_dirname}
    resolved to the job's folder name, whose = and , composing the defaults again could not parse."""
    return as_written(hydra.overrides.hydra)


def _one_checkpoint(a: str, b: str) -> bool:
    """Whether paths a and b name one checkpoint (a run's folder and its newest file): where
    checkpoint= and trainer.resume= named two, the second went unread, without a word."""
    try:
        return find_checkpoint(a).resolve() == find_checkpoint(b).resolve()
    except CheckpointError:
        return False


def _check_options(config: DictConfig):
    """A run's options checked before Hydra makes its folder, as a sweep's jobs are: a value
    validate() refuses left a folder holding only .hydra/ and run.log. Hydra's node is set
    for ${hydra:...} in them as Hydra sets it for the run next (on a copy: that makes the
    node read-only), and set back after, as Hydra does after a run."""
    run = copy.deepcopy(config)
    with open_dict(run):
        del run["hydra"]
    before = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(copy.deepcopy(config))
    try:
        _configured(run, Path(config.hydra.run.dir), config.hydra, config.hydra.overrides.task, say=False)
    finally:
        HydraConfig.instance().cfg = before


def _sweep_checkpoint(run_dir: Path, hydra: DictConfig) -> str:
    """A sweep's job whose folder holds checkpoints goes on from them: the sweep, stopped,
    was started again in its folder, whose jobs it checked as its own (_refuse_another_jobs)."""
    return str(run_dir) if hydra.mode == RunMode.MULTIRUN and saved(run_dir / "checkpoints") else ""


def _unresolved(e: OmegaConfBaseException) -> ConfigError:
    """OmegaConf's error for an interpolation that resolves to nothing ('trainer.epochs=${data.foo}'),
    in one line naming the key."""
    return ConfigError(f"{e.full_key + ': ' if e.full_key else ''}{first_line(e)}")


def _take_options(cfg: TrainConfig, path: str, keys, hydra: DictConfig, task, say: bool) -> tuple[dict, dict]:
    """cfg takes those `keys` of the options of the run that wrote the checkpoint at `path`
    that its command line (the overrides `task`) does not give; returns the checkpoint's meta
    and those it gives otherwise, that cfg reads: (the checkpoint's value, cfg's) by key."""
    from trainer import checkpoint
    meta = checkpoint.read(Path(path))["meta"]
    written = recorded(meta.get("config", meta.get("options", {})))  # "options": the model's alone, in older ones
    # one that kept the model's alone ("options") holds all that an export reads; evaluated, it takes the defaults' data
    if say and "config" not in meta and not (cfg.mode == "export" and "options" in meta):
        log.warning("%s was written before checkpoints kept every option of their run: give the options it was "
                    "started with (its run's .hydra/overrides.yaml lists them)", path)
    defaults = GlobalHydra.instance().config_loader().load_configuration(
        hydra.job.config_name, _hydras_overrides(hydra), RunMode.RUN)
    with open_dict(defaults):
        del defaults["hydra"]
    choices = given(task)
    read = {key: value for key, value in choices.items() if not unread_in(cfg.mode, key)}  # _read_by_mode's
    named = given_options(cfg, {*read, *chosen_keys(read)}, expand_paths(OmegaConf.to_object(defaults)))
    # those this configuration reads: a ResNet's checkpoint sets fastnet's model.widths too, without effect
    taken = {key: value for key, value in take_options(cfg, written, keys, named).items() if read_by(cfg, key)}
    # read by the model taken: model.depth given for a cifar_resnet's checkpoint, with the defaults' fastnet before
    changed = {key: values for key, values in given_changes(cfg, written, keys, named).items() if read_by(cfg, key)}
    listed = {key: values for key, values in changed.items() if key not in INITIAL_VALUES}  # those said below
    if listed and say:
        log.info("this command changes the options of the run that wrote %s: %s", path,
                 " ".join(f"{key}={now} (was {then})" for key, (then, now) in listed.items()))
    if taken and say:
        log.info("as the run that wrote %s: %s", path, " ".join(f"{key}={value}" for key, value in taken.items()))
    # with the run's options: ema_decay without its EMA; evaluating, the optimizer's, which only training reads; and
    # those that set where training starts (model.head_std), which the checkpoint holds
    warnings = [*unread_by_mode(cfg, choices), *ignored(cfg, named), *replaced_by_checkpoint(path, changed)]
    for why in warnings if say and _is_main() else ():
        log.warning("%s", why)
    return meta, changed


def run_eval(cfg: TrainConfig, run_dir: Path):
    from trainer import dist
    from trainer.loop import Trainer
    from trainer.metrics import to_json, write_summary
    trainer = Trainer(cfg, run_dir, dist.start(cfg), evaluate_only=True)
    result = trainer.evaluate()
    if trainer.dist.is_main:
        print(to_json(result))
        write_summary(run_dir, {**result, "checkpoint": cfg.trainer.resume})


def run_export(cfg: TrainConfig, run_dir: Path):
    import torch

    from trainer import checkpoint
    from trainer.arena import Arena
    from trainer.binding import bind
    from trainer.export import state_dict
    from trainer.setup import make_plans
    path = cfg.trainer.resume
    # one batch for the data's sizes: the model's regions, which export reads, do not depend on
    # them, and the data set, which it does not read, need not be there
    model, plans, _ = make_plans(cfg, sizes=(cfg.trainer.batch_size,) * 2)
    arena = Arena(plans.main)
    tensors = plans.tensors[plans.variants[0].name]
    bind(model, tensors, arena)
    checkpoint.load(Path(path), arena, checkpoint.identity(cfg), model_only=True)
    if _is_main():
        # what rebuilds the model the tensors fit, which .hydra/ (this command's) does not hold:
        # the checkpoint's model options (a fast net's logit_scale is no tensor; a ResNet's stem).
        # Written before the weights, which make the folder an export's (RESULTS): one that failed
        # after them (a disk just full) left a folder that the same command, run again, was refused
        with writing(run_dir / "model.json") as f:
            f.write(json.dumps({"model": dataclasses.asdict(cfg.model), "checkpoint": str(path)}, indent=1).encode())
        weights = state_dict(tensors, arena, cfg.ema)
        with writing(run_dir / "model_state_dict.pt") as f:
            torch.save(weights, f)
        log.info("wrote %s and the model's options in %s (from %s)", run_dir / "model_state_dict.pt",
                 run_dir / "model.json", path)


def run_bench(cfg: TrainConfig, run_dir: Path):
    from trainer import bench, dist
    device = dist.device_for(cfg.device, dist.from_env())
    if _is_main():
        for why in unread_by_mode(cfg, given(HydraConfig.get().overrides.task)):  # trainer.epochs, data.flip
            log.warning("%s", why)
        # an option no timed optimizer reads (optimizer.lars_eta is read where it times lars)
        unread = [ignored(c) for c in bench.with_optimizers(cfg, cfg.bench.optimizers)] or [ignored(cfg)]
        for why in unread[0]:
            if all(why in others for others in unread[1:]):
                log.warning("%s", why)
        if {"optimizer", "optimizer.name"} & set(given(HydraConfig.get().overrides.task)) and \
                cfg.optimizer.name not in cfg.bench.optimizers:
            log.warning("optimizer=%s has no effect with mode=bench: it times the optimizers bench.optimizers lists "
                        "(%s)", cfg.optimizer.name, ", ".join(cfg.bench.optimizers))
    text = bench.run(cfg, device, cfg.bench.optimizers)
    print(text)  # each rank's, of its own GPU
    if not _is_main():
        return
    with writing(run_dir / "bench.md") as f:
        f.write((text + "\n").encode())
    if cfg.bench.out:
        try:
            with open(cfg.bench.out, "a") as f:
                f.write("\n" + text + "\n")
        except OSError as e:  # checked before the timing (config.validate); a disk full since
            raise ConfigError(f"bench.out={cfg.bench.out} cannot be written ({e.strerror}): the table is in "
                              f"{run_dir / 'bench.md'}") from None


MODES = {"plan": run_plan, "train": run_train, "eval": run_eval, "export": run_export, "bench": run_bench}


def _stops_the_run(callback):
    """Hydra turns what a callback raises into a warning and starts the job anyway, past the
    checks the callback makes (and with a folder made for a run that then fails): an error
    in one ends the command here, with its message (the checks raise ConfigError), or with
    its traceback where it is not one of ours."""
    @functools.wraps(callback)
    def stopping(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except (TrainerError, OmegaConfBaseException) as e:
            # they check the command line (its values, the checkpoint it names) and the folder, which every rank of
            # a torchrun job meets alike; one that rank 0 did not meet, its rank says after waiting for it
            say_refusal(_unresolved(e) if isinstance(e, OmegaConfBaseException) else e, alike=True)
            raise SystemExit(2)
        except Exception:
            traceback.print_exc()
            raise SystemExit(1)
    return stopping


JOBS = "jobs.jsonl"  # in a sweep's folder: a line for each job that ended, with why it failed or its results


class RunDirectory(Callback):
    """Checks the run's folder before Hydra makes it and writes its .hydra/ files there: one
    Hydra cannot make (read-only, under a file) ends in its traceback, and a folder must not
    be another run's (trainer.run_dir), whose command line .hydra/ keeps. Either is one
    message here (conf/train.yaml names this callback); a sweep's jobs' folders likewise.
    A sweep's job that fails (a diverged learning rate, a missing file) does not stop the
    jobs after it: the sweep ends by naming the failed ones, with a non-zero exit. Each job
    that ends adds its line to the sweep folder's JOBS file, where the sweep reads them: a
    launcher may run the jobs, and their callbacks, in processes of its own (joblib,
    submitit). A line that cannot be written (a full disk) is said once, and kept here for
    the sweep's end, which it reaches where the jobs run in this process: Hydra made what a
    callback raised a warning, and the sweep ended without counting that job."""
    unwritten: tuple = ()  # the lines this process could not add to JOBS

    @_stops_the_run
    def on_run_start(self, config: DictConfig, **kwargs):
        expand_paths(config)
        _expand_home(config, "run")
        read = config.trainer.resume if config.mode == "train" else config.checkpoint or config.trainer.resume
        # a restart of a torchrun job goes on from its folder's newest checkpoint, not from `read`
        if read and config.mode in ("train", "eval", "export") and not restarted(config.hydra.run.dir):
            find_checkpoint(read)  # before Hydra makes a folder for a run that cannot start
        named = "hydra.run.dir" in given(config.hydra.overrides.hydra)
        if config.mode == "train" and config.trainer.resume:
            named = _continue_in_its_folder(config) or named
        if named and _is_main():  # the ranks of a torchrun job share the folder, whose results rank 0 writes
            _refuse_another_runs(Path(config.hydra.run.dir), config)
        _check_options(config)
        if not named:
            _new_folder(config, "run")  # new, and so nobody's
        else:
            _make(config.hydra.run.dir, "hydra.run.dir")
        if _is_main():
            _hold(config.hydra.run.dir)

    @_stops_the_run
    def on_multirun_start(self, config: DictConfig, **kwargs):
        _expand_home(config, "sweep")
        named = "hydra.sweep.dir" in given(config.hydra.overrides.hydra)
        if not named:
            _validate_jobs(config)
            _new_folder(config, "sweep")
        else:
            _refuse_empty(config.hydra.sweep.dir, "hydra.sweep.dir")  # made absolute, it would be the current folder
            _pin_sweep_folder(config)  # its jobs' folders, which _validate_jobs checks, composed with ~ expanded
            sweep = Path(config.hydra.sweep.dir)
            _sweep_as_started(config, sweep)
            earlier = _failed_before(sweep)
            # their folders, with their numbers and overrides; None for a sweeper that chooses them as it goes
            jobs = _validate_jobs(config, named=True, earlier=earlier)
            for job in sorted(sweep.iterdir()) if sweep.is_dir() else ():
                if job.is_dir() and (jobs is None or job not in jobs) and other_run(job, ""):
                    raise _another_sweeps(sweep, job, config)
            _make(config.hydra.sweep.dir, "hydra.sweep.dir")
        _hold(config.hydra.sweep.dir)
        if named:  # an earlier attempt's lines, but for the failures its jobs stand by (_refuse_another_jobs):
            # those whose folders, checked as this sweep's own, still hold that attempt's records and no checkpoint
            # numbered as this attempt numbers them, so that a job's line of this attempt supersedes its own
            failed = [{**earlier[_failed_key(_shown(job))], "job": number}
                      for folder, (number, job) in sorted(jobs.items(), key=lambda item: item[1][0])
                      if _failed_key(_shown(job)) in earlier and _stands_failed(folder)] if jobs else []
            _write_jobs(Path(config.hydra.sweep.dir) / JOBS, failed)
        _pin_sweep_folder(config)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs):
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        # main returns JobFailed for a job that failed (a FAILED status's return_value raises)
        ended = job_return.status == JobStatus.COMPLETED
        failed = ended and isinstance(job_return.return_value, JobFailed)
        job = {"job": config.hydra.job.num, "overrides": _shown(job_return.overrides),
               "failed": str(job_return.return_value) if failed else None,
               "summary": _summary(Path(config.hydra.runtime.output_dir)) if ended and not failed else None}
        path = Path(config.hydra.sweep.dir) / JOBS
        try:
            with open(path, "a") as f:  # one write: the jobs' lines do not mix
                f.write(json.dumps(job) + "\n")
        except OSError as e:
            print(f"warning: cannot write {path} ({e.strerror or e}): the sweep's end counts job {job['job']} only "
                  "where it ran in the sweep's own process", file=sys.stderr)
            self.unwritten += (job,)

    def on_multirun_end(self, config: DictConfig, **kwargs):
        path = Path(config.hydra.sweep.dir) / JOBS
        jobs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        # a job's latest line: one that failed in an earlier attempt has that line and its own
        jobs = sorted({job["job"]: job for job in [*jobs, *self.unwritten]}.values(), key=lambda job: job["job"])
        failed = [f"job {job['job']} ({job['overrides']}): {job['failed']}" for job in jobs if job["failed"]]
        if failed:
            print(f"{len(failed)} of the sweep's {len(jobs)} jobs failed (each job's run.log in "
                  f"{config.hydra.sweep.dir} has its details):\n" + "\n".join(failed), file=sys.stderr)
            raise SystemExit(2)


def _summary(run_dir: Path) -> dict | None:
    """A sweep's job's results, for its JOBS line, so that the sweep's jobs compare in one file:
    its summary.json, None for a mode that writes none (plan, bench, export)."""
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _validate_jobs(config: DictConfig, named: bool = False, earlier: dict | None = None):
    """Every job of a sweep validated before the first one runs: Hydra composes them all
    first, which catches a misspelled key or a wrong type, but a value validate() refuses
    in a job listed late would stop the sweep only after the jobs before it had trained.
    In a sweep folder the command line `named`, each job's folder is checked as a run's is
    (`earlier`: the jobs that failed in an earlier attempt, _failed_before)."""
    if config.hydra.sweeper._target_ != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
        return None  # other sweepers choose their jobs as they go
    loader = GlobalHydra.instance().config_loader()
    # as the sweeper reads them: its params resolved (Hydra resolves them as it makes it), the
    # command line's overrides not (an interpolation there is the job's to resolve)
    params = config.hydra.sweeper.params
    params = [f"{key}={value}" for key, value in (OmegaConf.to_container(params, resolve=True) if params else {}).items()]
    task = OmegaConf.to_container(config.hydra.overrides.task)
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(params + task)
    for o in overrides:
        if o.is_interval_sweep():  # the basic sweeper's own refusal is a traceback
            raise ConfigError(f"{o.input_line}: Hydra's basic sweeper runs lists (a,b,c), range() and choice(); "
                              "interval() is for a sweeper that samples (a hydra/sweeper plugin such as optuna)")
        if o.is_sweep_override() and not list(o.sweep_string_iterator()):  # the sweep would launch 0 jobs, and end 0
            raise ConfigError(f"{o.input_line} sweeps over no value: the sweep would have no jobs; give it one or more")
    first = {}
    for o in overrides[len(params):]:  # the command line's (of the config's params, it gives the key's values)
        before = first.setdefault(o.get_key_element(), o)
        if before is not o and (before.is_sweep_override() or o.is_sweep_override()):  # the sweeper takes the later
            raise ConfigError(f"{o.get_key_element()} is given twice ({before.input_line} and {o.input_line}): the "
                              "sweep would run the later's values alone; give it once, with every value to sweep")
    folders, sizes = {}, {}
    for number, job in enumerate(BasicSweeper.split_arguments(overrides, None)[0]):
        try:
            job_config = loader.load_sweep_config(config, list(job))
        except HydraException as e:  # what composing refuses beyond refused_override's checks (+key of a key there)
            why = f"{e}: {e.__cause__}" if e.__cause__ else e  # a value of the wrong type: OmegaConf's reason
            raise ConfigError(f"sweep job {number} ({_shown(job)}): {why}") from None
        with open_dict(job_config):
            job_config.hydra.job.num = job_config.hydra.job.id = number  # as Hydra's launcher sets them
            folder = Path(job_config.hydra.sweep.dir) / job_config.hydra.sweep.subdir
            del job_config["hydra"]
        if folder in folders:  # the later job would be refused there, after Hydra wrote its .hydra/ over the first's
            raise ConfigError(f"sweep jobs {folders[folder][0]} and {number} would both run in {folder}: give each job "
                              f"a folder of its own with hydra.sweep.subdir (its default, ${{hydra.job.num}}, does); no "
                              "job has run")
        folders[folder] = number, list(job)
        if named:  # a folder the sweep is given, not a new one: before Hydra writes the job's .hydra/ over a run's
            _refuse_another_jobs(folder, job_config, config, number, list(job), earlier or {})
        try:  # with the options a job that reads a checkpoint takes from it, as it will as it starts
            cfg = _configured(job_config, folder, config.hydra, list(job), say=False)
            if cfg.mode in ("train", "plan"):
                _check_set_up(cfg, sizes)
        except TrainerError as e:
            raise ConfigError(f"sweep job {number} ({_shown(job)}): {e}; no job has run") from None
    return folders


def _sweep_as_started(config: DictConfig, sweep: Path):
    """The command line's swept keys put in the order the sweep's earlier attempt in its folder
    gave them (its multirun.yaml), which numbers the jobs: the same sweep with its keys in
    another order (amp=true,false optimizer=sgd,lars) found each job's folder holding another
    job's records, and was refused as another sweep."""
    loader = GlobalHydra.instance().config_loader()
    parser = OverridesParser.create(config_loader=loader)
    task = OmegaConf.to_container(config.hydra.overrides.task)  # as given: ${...} is the job's to resolve
    earlier = _earlier_sweep(sweep)
    if earlier is None:
        return
    earlier = [o.get_key_element() for o in earlier if o.is_sweep_override()]
    parsed = parser.parse_overrides(task)
    places = [i for i, o in enumerate(parsed) if o.is_sweep_override()]
    swept = {parsed[i].get_key_element(): task[i] for i in places}
    if len(swept) != len(places) or sorted(swept) != sorted(earlier):  # another sweep, or one _validate_jobs refuses
        return
    for i, key in zip(places, earlier):
        task[i] = swept[key]
    with open_dict(config):
        config.hydra.overrides.task = task


def _earlier_sweep(sweep: Path) -> list | None:
    """The command line's overrides, parsed, of the sweep's earlier attempt in its folder (its multirun.yaml), or None."""
    try:
        task = OmegaConf.to_container(OmegaConf.load(sweep / "multirun.yaml").hydra.overrides.task)
        return OverridesParser.create(config_loader=GlobalHydra.instance().config_loader()).parse_overrides(task)
    except (OSError, OmegaConfBaseException, HydraException, TypeError):  # none there, or not a sweep's record
        return None


def _swept_otherwise(sweep: Path, config: DictConfig) -> tuple[list, list] | None:
    """The swept values of the sweep's earlier attempt in its folder and this command's, where
    only they differ (a value removed, or one added that numbers the jobs anew): the same sweep
    with a changed command line, whose jobs' folders hold jobs it no longer has or numbers
    otherwise. None where it is another sweep."""
    earlier = _earlier_sweep(sweep)
    if earlier is None:
        return None
    now = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader()).parse_overrides(
        OmegaConf.to_container(config.hydra.overrides.task))
    (then_swept, then_fixed), (now_swept, now_fixed) = [
        ({o.get_key_element(): o.input_line for o in parsed if o.is_sweep_override()},
         _the_job([o.input_line for o in parsed if not o.is_sweep_override()])) for parsed in (earlier, now)]
    if then_fixed != now_fixed or sorted(then_swept) != sorted(now_swept) or then_swept == now_swept:
        return None
    changed = [key for key in then_swept if then_swept[key] != now_swept[key]]
    return [then_swept[key] for key in changed], [now_swept[key] for key in changed]


def _check_set_up(cfg: TrainConfig, sizes: dict):
    """What a job's set-up refuses beyond validate(), for a sweep's jobs before the first:
    a batch larger than the data set, images the model shrinks to nothing, a freeze of a
    part the model lacks, Triton kernels without a GPU, a crop padding not smaller than the
    small images (the embedded set's, CIFAR-10's). The plan is built (a fraction of a
    second); the data set's size is read once for the jobs that share its options (`sizes`)."""
    import kernels
    from trainer.data import dataset_sizes, source_module
    from trainer.dist import Dist, device_for
    from trainer.setup import make_plans
    if cfg.mode == "train":
        kernels.load(cfg.kernels, device_for(cfg.device, Dist()))
    if cfg.mode == "train" and cfg.data.name in ("synthetic", "cifar10"):  # the data sets whose training crops pad
        source_module(cfg.data).check_training_crops(cfg.data)
    data = repr(cfg.data)
    if data not in sizes:
        sizes[data] = dataset_sizes(cfg.data)
    make_plans(cfg, cfg.dist.plan_ranks or 1, sizes[data])


def _refuse_another_jobs(folder: Path, job_config: DictConfig, config: DictConfig, number: int, job: list[str],
                         earlier: dict):
    """A sweep's job continues in its folder only its own earlier attempt: the same sweep
    run again in its folder (hydra.sweep.dir) after it was stopped goes on with each job
    from its newest checkpoint (_configured), starts the jobs that had not run, and runs
    those of another mode (plan, eval, export) again, which write the same results. A folder
    with another run's records, or with this job's records and no checkpoint (it was
    stopped before its first), is refused, and so is a file where the job's folder would
    be. A job that failed before its first checkpoint (diverged, on a damaged file: `earlier`
    says why) stands failed, and the sweep goes on with the others (main)."""
    shown = f"sweep job {number} ({_shown(job)})"
    if folder.exists() and not folder.is_dir():  # Hydra's launcher failed on it after the jobs before it had run
        raise ConfigError(f"{shown} runs in {folder}, which is a file: move it, or give the sweep a folder of its own "
                          "(hydra.sweep.dir=...)")
    if not other_run(folder, ""):
        return
    sweep = Path(config.hydra.sweep.dir)
    if folder.parent != sweep:  # hydra.sweep.subdir=. or a path elsewhere: a run's folder
        return _refuse_another_runs(folder, job_config)
    if config.hydra.output_subdir is None:
        raise ConfigError(f"{sweep} holds a sweep's jobs, and under hydra.output_subdir=null their folders keep no "
                          f"record of their overrides to go on by: give this sweep a folder of its own "
                          f"(hydra.sweep.dir=...), or continue a job's run alone ({override('trainer.resume', folder)})")
    started = _started_as(folder, config)
    if started is None or _the_job(started) != _the_job(job):
        raise _another_sweeps(sweep, folder, config)
    if job_config.mode == "train" and not saved(folder / "checkpoints") and _failed_key(_shown(job)) not in earlier:
        raise ConfigError(f"{shown} ended before its first checkpoint (stopped, or failed: {folder / 'run.log'} says "
                          f"why), and {folder} holds its records: remove {folder}, then run the sweep again to start "
                          "that job anew")


def _stands_failed(folder: Path) -> bool:
    """Whether a sweep's job that failed in an earlier attempt fails again without running:
    its folder holds that attempt's records and no checkpoint to go on from (a job whose
    folder was removed, or that failed before it wrote any record, such as on a damaged
    file since mended, runs anew)."""
    return bool(other_run(folder, "")) and not saved(folder / "checkpoints")


def _failed_before(sweep: Path) -> dict[tuple, dict]:
    """The JOBS lines of the jobs that failed in the sweep's earlier attempt in its folder, by
    their overrides (_failed_key): its numbers are not this attempt's where a swept key's
    values come in another order."""
    try:
        jobs = [json.loads(line) for line in (sweep / JOBS).read_text().splitlines()]
        return {_failed_key(job["overrides"]): job for job in jobs if job["failed"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none, or not the sweep's record
        return {}


def _failed_key(shown: str) -> tuple:
    """A sweep's job by its overrides as a JOBS line shows them (_shown), in any order: a value
    with a space splits alike in this attempt's job and in the earlier attempt's line."""
    return tuple(_the_job(shown.split(" ")))


def _write_jobs(path: Path, jobs: list[dict]):
    if jobs:
        path.write_text("".join(json.dumps(job) + "\n" for job in jobs))
    else:
        path.unlink(missing_ok=True)


def _the_job(overrides: list[str]) -> list[str]:
    """What makes a sweep's job the one it is: its overrides, in any order, but for those a
    sweep run again to go on may give otherwise (GOING_ON: a later trainer.stop_after_epoch,
    or none, goes on past the one it stopped at)."""
    return sorted(o for o in overrides if o.partition("=")[0].lstrip("+~") not in GOING_ON)


def _started_as(folder: Path, config: DictConfig) -> list[str] | None:
    """The overrides a sweep's job in `folder` was started with (Hydra's record of them), or None."""
    try:
        return list(OmegaConf.load(folder / config.hydra.output_subdir / "overrides.yaml"))
    except (OSError, OmegaConfBaseException, TypeError):  # none there, or not a list
        return None


def _another_sweeps(sweep: Path, job: Path, config: DictConfig) -> ConfigError:
    if changed := _swept_otherwise(sweep, config):
        return ConfigError(f"{sweep} holds this sweep's jobs as its earlier attempt swept {' '.join(changed[0])}, "
                           f"where this command sweeps {' '.join(changed[1])}: run it with the earlier values, or give "
                           "this sweep a folder of its own (hydra.sweep.dir=...)")
    return ConfigError(f"{sweep} holds another sweep's jobs ({job.name}/ has its checkpoints or results): give this "
                       "sweep a folder of its own (hydra.sweep.dir=...); a sweep goes on in its folder only with the "
                       f"command line it was started with, but for trainer.stop_after_epoch and the machine's "
                       f"options ({', '.join(key for key in GOING_ON if key != 'trainer.stop_after_epoch')})")


def _shown(job) -> str:
    """A sweep job's overrides with each value that is a string as it reads: the sweeper
    escapes the grammar's special characters in them (${trainer.seed} as $\\{trainer.seed\\});
    a list or a dictionary keeps its escapes, which part its items."""
    parser = OverridesParser.create()

    def shown(text: str) -> str:
        try:
            (o,) = parser.parse_overrides([text])
        except HydraException:
            return text
        return f"{o.get_key_element()}={o.value()}" if isinstance(o.value(), str) else text
    return " ".join(shown(text) for text in job)


def _continue_in_its_folder(config: DictConfig) -> bool:
    """A resumed run goes on in the folder of the run it continues, unless hydra.run.dir
    names another (a branch), rather than in a new timestamped one that would hold only the
    rest of the run. Hydra writes the resumed command line beside the first one's, in
    .hydra/resumed_N, so that the folder keeps how its run was started. Whether the run goes
    on in its run's folder."""
    folder = resumed_folder(config.trainer.resume)
    moved = folder is not None and "hydra.run.dir" not in given(config.hydra.overrides.hydra)
    with open_dict(config):
        if moved:
            config.hydra.run.dir = str(folder)
        run_dir = Path(config.hydra.run.dir)
        if config.hydra.output_subdir and (run_dir / config.hydra.output_subdir).is_dir():
            numbers = [int(p.name.rpartition("_")[2]) for p in run_dir.glob(f"{config.hydra.output_subdir}/resumed_*")
                       if p.name.rpartition("_")[2].isdigit()]
            config.hydra.output_subdir = f"{config.hydra.output_subdir}/resumed_{max(numbers, default=0) + 1}"
    return moved


def _expand_home(config: DictConfig, kind: str):
    """~ in hydra.run.dir (hydra.sweep.dir) as the other paths take it, the home folder: Hydra
    made a folder named ~ in the current one, which a later rm -rf ~... would take for home."""
    if str(config.hydra[kind].dir).startswith("~"):
        with open_dict(config):
            config.hydra[kind].dir = os.path.expanduser(config.hydra[kind].dir)


def _pin_sweep_folder(config: DictConfig):
    """The sweep's folder as its jobs' configurations are composed again from Hydra's overrides
    (by the launcher, and by _validate_jobs): the folder made, or given with ~ expanded, absolute,
    as a job under hydra.job.chdir=true reads it from its own folder. The override as given named
    a folder ~ in the current one, so the jobs a sweep run again in ~/... found there were taken
    for another sweep's."""
    with open_dict(config):
        config.hydra.sweep.dir = os.path.abspath(config.hydra.sweep.dir)
        config.hydra.overrides.hydra = [
            # as given: hydra.sweep.subdir=${hydra.job.id} resolves in each job
            *(o for o in OmegaConf.to_container(config.hydra.overrides.hydra)
              if not o.lstrip("+~").startswith("hydra.sweep.dir=")),
            override("hydra.sweep.dir", config.hydra.sweep.dir, shell=False)]


def _new_folder(config: DictConfig, kind: str):
    """The run's (kind "run") or sweep's folder from the configuration's pattern, which the
    command line does not name, made now and this run's alone: the timestamped default is
    the same for runs started in the same second (a script starting one per GPU), and the
    later one would write its .hydra/ and log over the first's and then be refused. It
    takes the folder with _2 (_3, ...) after the name instead."""
    folder = os.path.normpath(config.hydra[kind].dir)  # a pattern ending in / would take .../_2
    _make(Path(folder).parent, f"hydra.{kind}.dir")
    for n in itertools.count(1):
        path = folder if n == 1 else f"{folder}_{n}"
        try:
            Path(path).mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            raise _cannot_make(path, e, f"hydra.{kind}.dir") from None
        with open_dict(config):
            config.hydra[kind].dir = path
        return


_HELD = []  # the folders this process holds locked, open for its life: the kernel lets go as it ends


def _hold(folder: str):
    """The run's (or sweep's) folder locked for this process's life, before anything is written
    there: two resumes of one run (a requeued job beside the one still ending), or runs given
    the same hydra.run.dir, passed the folder checks together and wrote their epochs and
    checkpoints over each other's."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        raise ConfigError(f"{folder} is in use by another run that has not ended (a resume of the same run, or one "
                          "given the same folder): wait for it to end, or give this run a folder of its own "
                          "(hydra.run.dir=...)") from None
    except OSError as e:  # a file system without flock on folders (NFS, Lustre without its flock option)
        os.close(handle)
        print(f"warning: {folder} cannot be locked ({e.strerror}); a second run in it at the same time would not be "
              "refused", file=sys.stderr)
        return
    _HELD.append(handle)


def _is_main() -> bool:
    """Rank 0 of a torchrun job (RANK; no torch in the callback), or a single process."""
    return ranks()[0] == 0


def _says_for_its_node() -> bool:
    """The first rank of its node (LOCAL_RANK 0), which says a refusal every rank meets (say_refusal)."""
    return ranks()[2] == 0


def _refuse_another_runs(folder: Path, config: DictConfig):
    """A training run continues only its own run in a folder; the other modes write their
    own results and .hydra/ and so keep out of a folder with another run's."""
    if config.mode == "train":
        why = other_run(folder, restart_checkpoint(folder) or config.trainer.resume)
    else:
        why = other_run(folder, "") and (f"{folder} holds another run's checkpoints or results: mode={config.mode} "
                                         "would write its own files over them; give it a folder of its own "
                                         "(hydra.run.dir=...)")
    if why:
        raise ConfigError(why)


ROOM = 16 * 1024  # what a run's folder must take before it starts: Hydra's .hydra/ records, 3 files of 2-4 kB


def _refuse_empty(folder: str, key: str):
    if not str(folder).strip():  # Hydra would write the run into the current folder
        raise ConfigError(f"{key} is empty: give the run a folder ({key}=...)")


def _make(folder: str, key: str):
    _refuse_empty(folder, key)
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _cannot_make(folder, e, key) from None
    try:  # a run's folder to resume in, on a disk now read-only or full: a file written there (os.access
        with tempfile.TemporaryFile(dir=folder) as probe:  # answers for the real user, not the one writing)
            probe.write(bytes(ROOM))  # a full disk still makes empty files, and Hydra writes .hydra/ after this
            probe.flush()
    except OSError as e:
        do = "make room there, or give the run another folder" if e.errno == errno.ENOSPC else "give one that can be written"
        raise ConfigError(f"cannot write in the run's folder {folder} ({e.strerror}); {do} with {key}=...") from None


def _cannot_make(folder, e: OSError, key: str) -> ConfigError:
    return ConfigError(f"cannot make the run's folder {folder} ({e.strerror}); give one that can be written with "
                       f"{key}=...")


def _where_to_continue(cfg: DictConfig, run_dir: Path, hydra: DictConfig) -> str:
    """How an interrupted training run goes on: from its newest checkpoint, which keeps the
    run's options, or from the one it resumed if it wrote none; a sweep's job, by running
    the sweep again in its folder (`hydra`: Hydra's node of the run)."""
    if hydra.mode == RunMode.MULTIRUN:
        return f"; to go on, {_sweep_goes_on(run_dir, hydra)}" if saved(run_dir / "checkpoints") else \
            f" before this job's first checkpoint; {_sweep_goes_on(run_dir, hydra)}"
    newest = _continue_from_newest(run_dir, cfg, hydra)
    if newest:
        return f"; {newest}"
    # a folder of its own, whose records refuse the same command (torchrun's job folder is named for it by its
    # job id, which a command run again may not share)
    if "hydra.run.dir" in given(hydra.overrides.hydra) and (cfg.trainer.resume or not launched()):
        return (f" before its first checkpoint: {run_dir} holds nothing to continue from; remove it and run the same "
                "command again")
    if cfg.trainer.resume:  # a checkpoint outside a run's folder: a new folder each time
        again = continue_with(cfg.trainer.resume, _world(), _options_to_go_on(cfg, cfg.trainer.resume, hydra))
        return f" before its first checkpoint; continue again from {again}"
    return " before the first checkpoint: nothing to continue from"


def _to_go_on(cfg: DictConfig, run_dir: Path, hydra: DictConfig) -> str:
    """How a training run that stopped on a damaged data file, or on another rank's failure,
    goes on from its newest checkpoint: an epoch whose evaluation failed was saved first."""
    if hydra.mode == RunMode.MULTIRUN:
        return _sweep_goes_on(run_dir, hydra)
    return _continue_from_newest(run_dir, cfg, hydra)


def _sweep_goes_on(run_dir: Path, hydra: DictConfig) -> str:
    """How a sweep whose job in run_dir stopped goes on: its command run again in its folder,
    once that job's records are removed where it has no checkpoint to continue from."""
    again = (f"run the sweep's command again with {override('hydra.sweep.dir', hydra.sweep.dir)}: "
             "each job goes on from its newest checkpoint, and the jobs not yet run start")
    found = saved(run_dir / "checkpoints")
    if found:
        return f"{again} (this one from {found[-1].name})"
    return f"remove {run_dir}, then {again}" if other_run(run_dir, "") else again


def _continue_from_newest(run_dir: Path, cfg: DictConfig, hydra: DictConfig) -> str | None:
    """How to continue from the run folder's newest checkpoint, None where it has none."""
    found = saved(run_dir / "checkpoints")
    if not found:
        return None
    options = _options_to_go_on(cfg, run_dir, hydra)
    return (f"continue from {found[-1].name} with {continue_with(run_dir, _world(), options)} (which takes this run's "
            f"{'other ' if options else ''}options from it)")


def _options_to_go_on(cfg: DictConfig, path, hydra: DictConfig) -> tuple[str, ...]:
    """This command's overrides but trainer.resume, where it resumes and gives options otherwise than the run that
    wrote the checkpoint at `path`: a resume that raised trainer.epochs or lowered optimizer.lr, stopped before it
    saved a checkpoint of its own, went on with trainer.resume alone at that run's values, without a word. None
    where the checkpoint keeps this command's options (one this run wrote)."""
    if not cfg.trainer.resume:
        return ()
    try:
        changed = _take_options(expand_paths(OmegaConf.to_object(cfg)), path, RUN_OPTIONS, hydra,
                                hydra.overrides.task, say=False)[1]
    except (TrainerError, OmegaConfBaseException):  # a checkpoint damaged since: the advice without them
        return ()
    if not changed:
        return ()
    return tuple(shlex.quote(o) for o in as_written(hydra.overrides.task) if given([o]).keys() != {"trainer.resume"})


def _world() -> int:
    return ranks()[1]


def _once_there_is_room(e: WriteError, cfg: DictConfig, run_dir: Path, hydra: DictConfig) -> str:
    """What to do after a file could not be written: make room (a full disk) or make it
    writable, then a training run continues from its newest checkpoint, if it has one; a
    sweep's job, with its sweep."""
    mend = ("make room there" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else
            "move the file that stands in its path" if e.errno in (errno.EEXIST, errno.ENOTDIR) else
            "move the folder that stands where it goes" if e.errno == errno.EISDIR else "make it writable")
    if cfg.mode != "train":
        return f"; {mend}, then run the command again"
    if hydra.mode == RunMode.MULTIRUN:
        return f"; {mend}, then {_sweep_goes_on(run_dir, hydra)}"
    newest = _continue_from_newest(run_dir, cfg, hydra)
    return f"; {mend}, then {newest or f'remove {run_dir} and run the command again'}"


class LogFile(logging.FileHandler):
    """The run's log file (conf/train.yaml names it for Hydra's logging). A write that fails (a
    full disk) is said once, and the log goes on on the console: logging would print a
    traceback for each line after it."""
    failed = False

    def emit(self, record):
        if not self.failed:
            super().emit(record)

    def handleError(self, record):
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            return super().handleError(record)
        self._fail(error)

    def close(self):
        try:  # its last lines, flushed
            super().close()
        except OSError as e:
            self._fail(e)

    def _fail(self, error: OSError):
        if not self.failed:
            print(f"warning: cannot write {self.baseFilename} ({error.strerror or error}): the log goes on on the "
                  "console alone", file=sys.stderr)
        self.failed = True


class JobFailed(str):
    """What a sweep's job that failed returns: why, for the sweep's last word."""


class Terminated(BaseException):
    """SIGTERM, as a scheduler preempting the job sends it: raised where the run is, as
    Ctrl-C raises KeyboardInterrupt, so that the run says where to continue from."""


def _raised_by_a_signal(e: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or Terminated that caused an error, if any: a signal that
    arrives while a C extension loads (one imported where trainer.signals.held does not hold
    it off) becomes its ImportError, caused by the interruption. An error raised while handling one
    (its context, not its cause) is an error of its own."""
    seen = set()
    while e is not None and id(e) not in seen:  # a chain of causes may loop
        if isinstance(e, (KeyboardInterrupt, Terminated)):
            return e
        seen.add(id(e))
        e = e.__cause__
    return None


def _stopped(e: BaseException, dict_cfg: DictConfig, run_dir: Path) -> SystemExit:
    """Ctrl-C or SIGTERM: logs one line saying where to continue from, and gives the exit
    with the shell's status. A checkpoint is written whole or not at all: those there are
    intact."""
    if _is_main():  # under torchrun Ctrl-C reaches every rank: rank 0, which writes the checkpoints, says it
        _say_stopped("interrupted" if isinstance(e, KeyboardInterrupt) else "terminated", dict_cfg, run_dir,
                     HydraConfig.get())
    return SystemExit(130 if isinstance(e, KeyboardInterrupt) else 143)  # as a shell reports SIGINT, SIGTERM


def _say_stopped(what: str, dict_cfg: DictConfig, run_dir: Path, hydra: DictConfig, after: str = ""):
    log.error("%s%s%s", what, _where_to_continue(dict_cfg, run_dir, hydra) if dict_cfg.mode == "train" else "", after)


def _restarts_left() -> str:
    """What torchrun's agent does next where it has restarts left: it stops the ranks so, as
    one failed, and starts the job again, which goes on from its newest checkpoint."""
    count, most = (os.environ.get(key, "0") for key in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"))
    left = int(most) - int(count) if count.isdigit() and most.isdigit() else 0
    return (f"; where torchrun's agent restarts the job ({left} restart(s) left, unless the agent itself was "
            "stopped), the job goes on from its newest checkpoint by itself") if left > 0 else ""


RANK_0_ENDS_S = 10  # the longest another rank waits for rank 0 to meet a refusal it met first (the agent
# checks its workers every 0.1 s)


def say_refusal(why, alike: bool):
    """Says refusal `why` on stderr. One that every rank of a torchrun job meets alike
    (TrainerError.alike) each rank said, and a user with 8 ranks read it 8 times: rank 0
    says it, and another rank waits for torchrun's agent, which stops every rank once one
    has ended (rank 0, once it has said it; were this rank to end first, the agent could
    stop rank 0 before it said it), and ends without a word. Where the agent does not stop
    it within RANK_0_ENDS_S, rank 0 did not meet the refusal (a node given another command
    line), and this rank says it. Each node's agent stops its own ranks alone: on each node
    its first rank (LOCAL_RANK 0; rank 0 on the first) says it, on that node's console."""
    if alike and not _says_for_its_node():
        for stop in STOPPING:  # the agent's SIGTERM, or Ctrl-C to every rank: rank 0 says why the job ended
            signal.signal(stop, lambda signum, frame: exit_at_once(signum, say=False))
        time.sleep(RANK_0_ENDS_S)
    print(why, file=sys.stderr)


class FileOnly(logging.Filter):
    """The console's filter (conf/hydra/job_logging/trainer.yaml): a line logged with
    extra={"file_only": True} is kept in the run's log file alone: a refusal that rank 0 says
    for this rank (say_refusal), a traceback that Hydra prints on the console itself."""

    def filter(self, record):
        return not getattr(record, "file_only", False)


_LAST_WORD = threading.Lock()  # rank 0's one line of why the run ended: the main thread's error, or torchrun's SIGTERM
_SAID: list[str] = []  # that line, once the main thread has said it


def _terminate_at_once(dict_cfg: DictConfig, run_dir: Path, hydra: DictConfig):
    """SIGTERM under torchrun (its agent stopping the job: a preemption, a peer's failure)
    ends this rank at once, where rank 0 first says where to continue from: the rank cannot
    unwind, as the others may be waiting for it in a collective, and the agent kills what is
    left after 30 s. A thread takes the signal, as Python's handlers run in the main thread
    alone, which may be waiting in a collective or on the device until it is killed."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)  # each signal Python handles writes its number there as it arrives
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the thread has ended the process by then

    def watch():
        while os.read(read, 1) != bytes([signal.SIGTERM]):  # Ctrl-C: raised in the main thread, as without torchrun
            pass
        # its handlers flush each line; an error the main thread is saying (a lost peer) is said once
        if _is_main() and _LAST_WORD.acquire(timeout=10) and not _SAID:
            _say_stopped("terminated", dict_cfg, run_dir, hydra, after=_restarts_left())
        exit_at_once(signal.SIGTERM, say=False)
    threading.Thread(target=watch, name="sigterm", daemon=True).start()


def _interrupt(signum, frame):
    """Ctrl-C, or SIGTERM where it is taken: the run unwinds and says where to continue from.
    The same signal again, while it winds down (a data set still loading, DALI's exit), ends
    the process at once, where it printed the tracebacks of whatever it broke into;
    checkpoints are written whole or not at all, so those there are intact."""
    signal.signal(signum, _exit_now)
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated


def _exit_now(signum, frame):
    exit_at_once(signum)


def main(dict_cfg: DictConfig):
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        signal.signal(signal.SIGINT, _interrupt)
        if launched():
            _terminate_at_once(dict_cfg, run_dir, HydraConfig.get())
        else:
            signal.signal(signal.SIGTERM, _interrupt)
        if swept() and dict_cfg.mode == "train" and _stands_failed(run_dir):
            job = _shown(OmegaConf.to_container(HydraConfig.get().overrides.task))
            before = _failed_before(Path(HydraConfig.get().sweep.dir)).get(_failed_key(job))
            if before:  # its sweep's earlier attempt ended it; run again, it would end so again
                again = f" (in the sweep's earlier attempt; to start this job anew, remove {run_dir} and run the sweep again)"
                why = before["failed"] if before["failed"].endswith(again) else before["failed"] + again
                log.error("%s", why)
                return JobFailed(why)
        cfg = _configured(dict_cfg, run_dir, HydraConfig.get(), HydraConfig.get().overrides.task)
        MODES[cfg.mode](cfg, run_dir)
    except TrainerError as e:
        # plan and bench start no process group, whose raise_failures would tell the ranks' errors apart: each rank
        # runs the same command alone, and say_refusal has a rank say one that the first did not meet
        e.alike = e.alike or dict_cfg.mode in ("plan", "bench")
        others = e.alike and not _says_for_its_node()  # its node's first rank says it: this rank's log keeps it
        with _LAST_WORD:  # torchrun's SIGTERM, which a lost peer brings too, then says nothing more
            why = f"{e}{_once_there_is_room(e, dict_cfg, run_dir, HydraConfig.get()) if isinstance(e, WriteError) else ''}"
            # rank 0 writes the checkpoints: another rank may look before the newest is in place
            if isinstance(e, (DataError, PeerError)) and dict_cfg.mode == "train" and _is_main() \
                    and saved(run_dir / "checkpoints"):
                why += f"; {'once that is mended' if isinstance(e, DataError) else 'to go on'}, " \
                       f"{_to_go_on(dict_cfg, run_dir, HydraConfig.get())}{_restarts_left()}"
            log.error("%s", why, extra={"file_only": others})
            _SAID.append(why)
        if others:
            say_refusal(why, alike=True)
        if swept() and not isinstance(e, WriteError):
            return JobFailed(why)  # the sweep goes on to its next job
        # a full disk stops a sweep too: the next job's folder would end in Hydra's traceback
        raise SystemExit(2)
    except (KeyboardInterrupt, Terminated) as e:
        raise _stopped(e, dict_cfg, run_dir) from None
    except Exception as e:
        if (signal_error := _raised_by_a_signal(e)) is not None:
            raise _stopped(signal_error, dict_cfg, run_dir) from None
        # into the run's log file; on the console Hydra prints the traceback itself, but for a sweep's job, whose
        # failure is returned for the sweep to go on
        log.exception("the run failed", extra={"file_only": not swept()})
        if swept():
            return JobFailed(f"{type(e).__name__}: {e}")  # the sweep goes on to its next job
        raise
