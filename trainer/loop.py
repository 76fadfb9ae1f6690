"""The training loop: epochs of replayed step graphs fed through the double buffer, an
evaluation after each, checkpoints, and the run's records.

Set-up reads top to bottom as the data flow of DESIGN.md: model -> plans -> arena ->
bind -> range ops -> programs -> executor. In steady state the host only enqueues:
it reads device values through TensorFutures at log steps and at the end of an epoch.
"""
import copy
import importlib
import itertools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Callable

import torch

import kernels
from trainer import checkpoint
from trainer.arena import HALF
from trainer.config import (INITIAL_VALUES, RUN_OPTIONS, ScheduleConfig, TrainConfig, ignored, options, take_options,
                            unreached)
from trainer.data import build_sources, dataset_sizes, source_module
from trainer.data.jpeg_files import forget_listings
from trainer.dist import Dist, device_for
from trainer.errors import ConfigError, DivergedError, WriteError
from trainer.feeder import BUFFERS, DoubleBuffer
from trainer.future import TensorFuture
from trainer.metrics import MetricsLog, Stopwatch, plot_curves, read_summary, write_summary
from trainer.plan import Baseline as B
from trainer.regions import Region as R
from trainer.run_dir import RECORDS, continue_with, other_run, processes, restart_checkpoint, run_folder, saved, swept
from trainer.schedule import lr_multipliers
from trainer.planner import bn_eps, first_conv
from trainer.setup import assemble, use_device
from trainer.whitening import whiten_first_conv

log = logging.getLogger("trainer")


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, dist: Dist, evaluate_only: bool = False):
        self.clock = Stopwatch()
        self.cfg, self.run_dir, self.dist = cfg, run_dir, dist
        run_dir.mkdir(parents=True, exist_ok=True)
        t = cfg.trainer
        self.device = device_for(cfg.device, dist)
        use_device(self.device, cfg)
        if self.device.type == "cpu" and cfg.amp and cfg.amp_dtype == "fp16":
            log.warning("amp=true with fp16 on the CPU: CPUs compute fp16 convolutions about 18x slower than "
                        "fp32 (the CIFAR recipe's net: 50 against 890 img/s); amp_dtype=bf16 is faster than fp32")
        torch.manual_seed(t.seed)

        failure = None
        try:
            model_and_plan = self._assemble(cfg, evaluate_only)
        except Exception as error:  # noqa: BLE001 - one rank's alone (its copy of the data set): every rank
            failure = error  # learns of it before the first collective, where the others failed in gloo's error
        dist.raise_failures(failure, "set-up")
        e = self.engine
        dist.prepare(e)
        self.model, self.plans, self.arena, self.ops, self.executor = e.model, e.plans, e.arena, e.ops, e.executor
        self.per_epoch = e.per_epoch
        self.total_steps = self.plans.main.config.schedule_steps
        said = dist.is_main and not (evaluate_only or t.resume)
        for why in [*ignored(cfg), *unreached(cfg, self.per_epoch, self.total_steps)] if said else []:
            log.warning("%s", why)  # once, as the run starts: a resume says what it changes (_check_unreached)
        self.feeder = DoubleBuffer(self.arena, self.plans.tensors)
        self.meta = checkpoint.identity(cfg)
        self.start_epoch, self.history = 0, []
        self.stopped = False  # a torchrun restart or a sweep's job after the checkpoint trainer.stop_after_epoch asked for
        self.images, self.train_seconds, self.first_step_s = 0, 0.0, None  # of this run, as train_epoch adds them
        self.trained_before = {"images": 0, "train_s": 0.0}  # by the runs this one resumes, to its checkpoint
        self.started_as = {}  # a resumed run's INITIAL_VALUES options, as its checkpoint kept them
        if t.resume:
            try:
                self._resume(t.resume, evaluate_only)
            except Exception as error:  # noqa: BLE001 - every rank meets a refusal of the checkpoint alike, and
                failure = error  # rank 0 alone says it; one rank's alone (its copy of the file) is named on the others
            dist.raise_failures(failure, "resume")
            log.info("%s %s, saved after epoch %d", "evaluating" if evaluate_only else "resumed from", t.resume,
                     self.start_epoch)
        # claimed once the checkpoint is accepted: a refused start leaves the folder free for a corrected one;
        # evaluation alone keeps no records (its result is summary.json)
        self.metrics = self._records(run_dir, claim=not evaluate_only, enabled=dist.is_main and not evaluate_only)
        ready = self.clock()
        # a finished run resumed, or torchrun restarting a job after its last checkpoint
        self.finished = not evaluate_only and (self.stopped or self.start_epoch >= math.ceil(t.epochs))
        # its last epoch has no evaluation (one that failed on a damaged image, or a stop between
        # evaluations with trainer.epochs lowered to it): evaluated now
        self.unevaluated = (self.finished and not self.stopped and self.start_epoch == math.ceil(t.epochs)
                            and bool(self.history) and "val_loss" not in self.history[-1])
        if self.stopped:
            again, go_on = (("a sweep run again goes on with this job", "a later trainer.stop_after_epoch, or none")
                            if swept() else ("torchrun restarted the job", continue_with(run_dir, dist.world)))
            log.info("%s after epoch %d's checkpoint, where trainer.stop_after_epoch=%d stops it: nothing left to train; "
                     "continue with %s", again, self.start_epoch, t.stop_after_epoch, go_on)
        elif self.unevaluated:
            log.info("%s has trained all %d epoch(s), the last without an evaluation (it failed, or was not due): "
                     "evaluating it now", t.resume, self.start_epoch)
        elif self.finished:
            log.info("%s has trained %d epoch(s), all that trainer.epochs=%g asks for: nothing left to train; raise "
                     "trainer.epochs to train on, or evaluate it with mode=eval checkpoint=%s",
                     t.resume, self.start_epoch, t.epochs, t.resume)
        elif cfg.compile:  # else a machine's first compile is minutes without a word
            log.info("compile=true: inductor compiles each program at its first call; a machine's first compile "
                     "takes minutes, later runs load it from %s in seconds",
                     Path(cfg.compile_cache).resolve() if cfg.compile_cache else "inductor's cache")
        # evaluation alone (mode=eval) needs no training graphs: their capture is seconds of set-up
        if not self.finished or self.unevaluated:
            self.executor.capture(self.executor.keys(train=False) if evaluate_only or self.finished else None)
        if cfg.ema:  # evaluation swaps the EMA weights in eagerly: compile those kernels now, not in the timed run
            self.ops.sema_switch()
            self.ops.sema_switch()
        self.setup_s = self.clock()
        # the parts: the data beside the model and plan, each its own time from the start; then,
        # once both are there (and a checkpoint is loaded), warm-up, compilation and capture
        self.setup_parts = {"data": round(self.data_s, 3), "model_and_plan": round(model_and_plan, 3),
                            "warm_up_compile_capture": round(self.setup_s - ready, 3)}
        log.info("set-up %.1f s: data %.1f s beside model and plan %.1f s, then warm-up, compilation and capture "
                 "%.1f s", self.setup_s, *self.setup_parts.values())

    def _resume(self, path: str, evaluate_only: bool):
        """The checkpoint's state into the arena, and its checks against this run."""
        done = checkpoint.load(Path(path), self.arena, self.meta, self.dist.rank, model_only=evaluate_only)
        self.start_epoch, self.history = done["epoch"], done.get("history", [])
        self._check_classes(path, done.get("classes"))
        if evaluate_only:
            return
        self.trained_before = done.get("trained") or self._trained_by_summary(path, done.get("steps"))
        # its weights and loss scale are the checkpoint's: what a command line gives for them set none of it
        self.started_as = {key: value for key, value in done.get("config", {}).items() if key in INITIAL_VALUES}
        self._check_epoch_length(path, done.get("steps_per_epoch"), done.get("train_examples"), done.get("config", {}),
                                 done.get("world"))
        self._check_world(path, done.get("world"))
        self._check_whole_epochs(path, done.get("steps"))
        step = done.get("steps", self.start_epoch * self.per_epoch)
        self._check_schedule(path, done.get("schedule_steps"), step, done.get("config"))
        self._check_unreached(done.get("schedule_steps"), step, done.get("config"))
        self.stopped = self._check_stop(path)

    def _assemble(self, cfg: TrainConfig, evaluate_only: bool) -> float:
        """The engine (model, plan, arena, graphs) and the data sources; the engine's own time."""
        t, dist = cfg.trainer, self.dist
        # The data loads in a thread beside the model, its plan and the compiler's import:
        # decoding runs in DALI's threads, outside the GIL, and in a fresh process the two
        # took 5-6 s each, one after the other. Imports stay on this thread (the data set's
        # module, DALI, the input kernel's module): two threads importing one module at once
        # may see it half initialized.
        source_module(cfg.data)
        forget_listings()
        kernels.load("auto", self.device)
        with ThreadPoolExecutor(1) as pool:
            data = pool.submit(self._load_data, cfg, not evaluate_only)
            if cfg.compile:  # inductor's import, otherwise paid at the first compilation
                importlib.import_module("torch._inductor.compile_fx")
            init, sizes = None, None
            if evaluate_only:  # the checkpoint's weights replace the initial ones; one training batch is planned
                sizes = (t.batch_size * dist.world, dataset_sizes(cfg.data, read_train=False)[1])
            elif t.first_conv_init == "whiten" and not t.resume:  # a resume's checkpoint replaces those weights
                init = lambda model: whiten_first_conv(first_conv(model), data.result()[0].peek(5000))
            self.engine = assemble(cfg, self.device, dist.world, init, grad_sync_factory=dist.grad_sync_factory,
                                   sizes=sizes)
            model_and_plan = self.clock()  # its own time: the data may still be loading
            self.train_source, self.val_source = data.result()
        return model_and_plan

    def _load_data(self, cfg: TrainConfig, read_train: bool):
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        sources = build_sources(cfg, self.device, self.dist.rank, self.dist.world,
                                HALF[cfg.amp_dtype] if cfg.amp else None, read_train)
        self.data_s = self.clock()
        return sources

    # -- the schedule of steps -----------------------------------------------------------
    def train_steps(self, epoch: int) -> list:
        """The variant of every step of `epoch`: full batches, the partial last batch when
        the data does not divide, low resolution in the progressive-resizing epochs, frozen
        twins once every freeze has happened; the fractional last epoch of a run stops part way."""
        t = self.cfg.trainer
        lowres = epoch < t.lowres_epochs
        base = self.engine.variant("train_lowres" if lowres else "train_base")
        steps = [base] * (self.train_source.size // t.batch_size)
        if len(steps) < self.per_epoch:
            steps.append(self.engine.variant("train_lowres_last" if lowres else "train_last"))
        steps = steps[:max(0, self.total_steps - epoch * self.per_epoch)]
        settle, first = self.engine.settle_step, epoch * self.per_epoch
        return [self.engine.variant(v.name + "_frozen") if settle is not None and first + i >= settle else v
                for i, v in enumerate(steps)]

    def val_steps(self) -> list:
        batch = self.engine.variant("val_base").batch
        steps = [self.engine.variant("val_base")] * (self.val_source.size // batch)
        if self.val_source.size % batch:
            steps.append(self.engine.variant("val_last"))
        return steps

    # -- running steps -------------------------------------------------------------------
    def run_steps(self, steps: list, source, on_step=None):
        """Replay the steps' graphs while the loader fills the other buffer."""
        if not steps:
            return
        self.feeder.fill(BUFFERS[0], steps[0], source)
        for i, v in enumerate(steps):
            buf = BUFFERS[i % 2]
            self.feeder.acquire(buf)
            self.executor.run(v.name, buf)
            self.feeder.release(buf)
            # The next batch is asked for only now: while the host waits for the loader
            # (file reads, DALI), the device already has this step to run.
            if i + 1 < len(steps):
                self.feeder.fill(BUFFERS[(i + 1) % 2], steps[i + 1], source)
            if on_step is not None:
                on_step(i, v)

    def train_epoch(self, epoch: int) -> Callable[[], dict]:
        """Enqueue the epoch's steps and return a function that waits for them and gives the
        epoch's row of training metrics. Until it is called the host does not wait for the device,
        so the next epoch's steps can be queued behind this one's."""
        steps = self.train_steps(epoch)
        resolution = steps[0].resolution if steps else self.cfg.data.resolution
        self.train_source.start_epoch(epoch, resolution)
        self.ops.reset_sums(B.TRAIN_SUMS)
        first_step = epoch * self.per_epoch
        log_every = self.cfg.trainer.log_every
        a = self.arena
        seen = list(itertools.accumulate(v.batch for v in steps))  # a rank's images up to each step

        def on_step(i, v):
            step = first_step + i + 1
            if i == 0 and epoch == self.start_epoch:
                self._first_step_done()
            if step % log_every == 0 or i == len(steps) - 1:
                results = TensorFuture(a.flat(R.R_RESULT).view(3, -1)[:, 0])  # loss, top-1, top-5
                self.metrics.step(step, epoch + 1, v.name, self.images + seen[i] * self.dist.world,
                                  results, a.to_host_async(self.plans.main[B.LR_WEIGHT]))
                self._check_finite(block=False)

        before = self._updates()
        start = self._event()
        self.run_steps(steps, self.train_source, on_step)
        end = self._event()
        self.dist.all_sum_(self.ops.s[B.TRAIN_SUMS])
        sums = a.to_host_async(self.plans.main[B.TRAIN_SUMS])  # copied out before the next epoch resets them
        after = self._updates()
        scale = a.to_host_async(self.plans.main[B.LOSS_SCALE]) if self.ops.dynamic_scale else None
        self.images += sum(v.batch for v in steps) * self.dist.world

        def result() -> dict:
            self._check_finite(block=True)
            self.train_seconds += self._elapsed(start, end)
            loss, top1, top5, count = sums.get().tolist()
            self._check_loss(loss / count)
            return {"epoch": epoch + 1, "train_loss": loss / count, "train_top1": top1 / count,
                    "train_top5": top5 / count, **self._skipped(epoch, len(steps), before, after, scale)}
        return result

    def _updates(self) -> tuple:
        """The steps taken and the updates applied, copied out behind the work enqueued: a
        step whose gradients were not finite skips its update."""
        return tuple(self.arena.to_host_async(self.plans.main[b]) for b in (B.STEP, B.OPT_STEP))

    def _skipped(self, epoch: int, steps: int, before: tuple, after: tuple, scale) -> dict:
        """The epoch's updates skipped for gradients that were not finite, and under fp16 the
        loss scale it ended on, for its row. Under fp16 a few skipped steps are the dynamic
        scale finding its level; an epoch that skipped every one trained nothing (a
        trainer.grad_scale_init far above fp16's range halves once a step), which is said.
        Without a loss scale, every skipped step is said."""
        (taken0, applied0), (taken, applied) = ([int(f.get()[0]) for f in pair] for pair in (before, after))
        skipped = (taken - applied) - (taken0 - applied0)
        row = {"skipped_steps": skipped} if scale is not None or skipped else {}
        if scale is not None:
            row["loss_scale"] = float(scale.get()[0])
        if skipped and self.dist.is_main and (scale is None or skipped == steps):
            log.warning("epoch %d skipped %d of its %d updates: their gradients were not finite%s", epoch + 1, skipped,
                        steps, f" in fp16 at every loss scale tried, down to {row['loss_scale']:.3g} now (it halves "
                        "at each overflow): start it lower (trainer.grad_scale_init) or use amp_dtype=bf16"
                        if scale is not None else ": lower optimizer.lr or add a warm-up (schedule.warmup_epochs)")
        return row

    def evaluate(self, warn: bool = True) -> dict:
        """The validation metrics. warn=False leaves the warning about a non-finite loss to
        the caller (`warn_not_finite`), which knows whether training's own loss was finite."""
        self.dist.average_bn(self.ops)
        if self.cfg.ema:
            self.ops.sema_switch()
        failure = None
        try:
            if self.cfg.fold_bn:  # from the weights evaluation uses: EMA's when EMA is on
                self.ops.fold_bn(*bn_eps(self.model))
            self.ops.reset_sums(B.VAL_SUMS)
            self.val_source.start_epoch(0, self.cfg.data.resolution)
            self.run_steps(self.val_steps(), self.val_source)
        except Exception as e:  # on this rank alone, perhaps: every rank hears of it below
            failure = e
        finally:  # a failed evaluation too: fit then saves the live weights, not the EMA's
            if self.cfg.ema:
                self.ops.sema_switch()
        self.dist.raise_failures(failure, "evaluation")
        self.dist.all_sum_(self.ops.s[B.VAL_SUMS])
        loss, top1, top5, count = self.arena.to_host_async(self.plans.main[B.VAL_SUMS]).get().tolist()
        row = {"val_loss": loss / count, "val_top1": top1 / count, "val_top5": top5 / count}
        if warn:
            self.warn_not_finite(row)
        return row

    def warn_not_finite(self, row: dict):
        if not math.isfinite(row["val_loss"]) and self.dist.is_main:  # training goes on: its own loss is finite
            log.warning("the validation loss is NaN or infinite although training's is not: evaluation, "
                        "with the running BatchNorm statistics, overflowed%s. The weights diverged early or "
                        "the statistics are not settled; lower optimizer.lr or add schedule.warmup_epochs",
                        " in fp16 (amp_dtype=bf16 has fp32's range)" if self.cfg.amp and self.cfg.amp_dtype == "fp16"
                        else "")

    # -- the run ---------------------------------------------------------------------------
    def fit(self) -> dict:
        t = self.cfg.trainer
        epochs = math.ceil(t.epochs)
        run_start, result_at = self._event(), None
        pending = None  # the previous epoch's row: read once this epoch is queued behind it
        summary = None  # as of the newest checkpoint: a run always ends on one where it trained
        if self.unevaluated:  # its checkpoint is saved again with the row, for a later resume's summary
            self._record({**self.history.pop(), **self.evaluate()})
            result_at = self._event()
            self.save(self.start_epoch)
            summary = self._write_summary(run_start, result_at, evaluated=True)
        for epoch in range(self.start_epoch, self.start_epoch if self.stopped else epochs):
            result = self.train_epoch(epoch)
            if pending is not None:
                self._record(pending())
            last = epoch + 1 == epochs
            stopping = bool(t.stop_after_epoch) and epoch + 1 >= t.stop_after_epoch
            evaluating = last or (epoch + 1) % t.eval_every == 0
            saving = last or stopping or (t.checkpoint_every and (epoch + 1) % t.checkpoint_every == 0)
            if not (evaluating or saving):
                pending = result
                continue
            # evaluation is queued before the epoch's metrics are read, so the device goes
            # straight from the last training step to the first evaluation step
            evaluation = {}
            if evaluating:
                try:
                    # its warning of a non-finite loss waits for result(), which stops a run whose
                    # training loss diverged: the warning says that training's is finite
                    evaluation = self.evaluate(warn=False)
                except Exception:
                    self._save_trained(epoch, result, run_start, result_at)
                    raise
                result_at = self._event()  # time to accuracy ends here, before any checkpoint is written
            pending = None
            row = {**result(), **evaluation}
            if evaluation:
                self.warn_not_finite(evaluation)
            self._record(row)
            if saving:
                self.save(epoch + 1)
                summary = self._write_summary(run_start, result_at)
            if stopping and not last:
                log.info("stopping after epoch %d as trainer.stop_after_epoch asks; continue with %s (which takes "
                         "this run's options from its checkpoint)", epoch + 1, continue_with(self.run_dir, self.dist.world))
                break
        self.metrics.close()
        return summary if summary is not None else self._write_summary(run_start, result_at)

    def _save_trained(self, epoch: int, result, run_start, result_at):
        """An evaluation failed (a damaged validation image): the epoch just trained is saved
        with its training row, as its checkpoint would have been, so that a resume once the
        data is mended goes on from it instead of training it again. In a job of several
        ranks every rank comes here, as the one that failed has told the others."""
        self._record(result())  # a diverged epoch raises here, and is not saved
        self.save(epoch + 1)
        self._write_summary(run_start, result_at)

    def _write_summary(self, run_start, result_at, evaluated: bool = False) -> dict:
        """The run's summary as of its newest epoch, written with its curves at each checkpoint,
        so that an interrupted run's records are those of the checkpoint it resumes from; not
        over a finished run's own by a resume that trains nothing (its timings would be of
        nothing), unless it `evaluated` the last epoch or that summary is not of the newest
        checkpoint (the run was killed between the two). run_start to result_at: this
        process's time to its last evaluation result."""
        summary = self.summary(None if result_at is None else self._elapsed(run_start, result_at))
        if self.dist.is_main and (self.images or evaluated or read_summary(self.run_dir).get("steps") != summary["steps"]):
            write_summary(self.run_dir, summary)
            if self.history:
                plot_curves(self.run_dir, self.history)
        return summary

    def _trained_by_summary(self, path: str, steps: int | None) -> dict:
        """The images and seconds of training so far, for a checkpoint written before they
        were kept in it (2026-12-02): from its run's summary.json where that is of the same
        step; else none, which is said, as the summary's figures then count from here."""
        summary = read_summary(run_folder(path))
        if steps is not None and summary.get("steps") == steps and summary.get("train_s") and summary.get("images_per_s"):
            return {"images": round(summary["images_per_s"] * summary["train_s"]), "train_s": summary["train_s"]}
        if self.dist.is_main:
            log.warning("%s does not keep the training time before it (a checkpoint written before 2026-12-02): "
                        "summary.json's train_s and images_per_s count from this resume", path)
        return {"images": 0, "train_s": 0.0}

    def _record(self, row: dict):
        self.history.append(row)
        self.metrics.epoch(row)

    def save(self, epochs_done: int):
        if not self.cfg.ema:
            # B_PREV as evaluation makes it, for export, which reads it: an epoch that was not
            # evaluated has left older statistics there (EMA keeps B_PREV up to date itself)
            self.dist.average_bn(self.ops)
        per_rank = self.dist.gather_per_rank(self.arena)  # every rank takes part; rank 0 writes
        if not self.dist.is_main:
            return
        folder = self.run_dir / "checkpoints"
        meta = {**self.meta, "config": {**options(self.cfg), **self.started_as}, "epoch": epochs_done,
                "history": self.history, "steps_per_epoch": self.per_epoch,
                "steps": min(epochs_done * self.per_epoch, self.total_steps),
                "schedule_steps": self.total_steps, "train_examples": self.train_source.shard.total,
                "classes": self.val_source.classes, "trained": self._trained(), "world": self.dist.world}
        checkpoint.save(folder / f"epoch_{epochs_done:04d}.pt", self.arena, meta, per_rank)
        checkpoint.prune(folder, self.cfg.trainer.keep_checkpoints)

    def summary(self, result_seconds: float | None) -> dict:
        """The newest evaluation's results (an epoch that was not evaluated has none) and the
        newest epoch's training loss."""
        steps = int(self.arena.to_host_async(self.plans.main[B.STEP]).get()[0])
        evaluated = next((row for row in reversed(self.history) if "val_top1" in row), {})
        trained = self._trained()
        return {**{k: evaluated.get(k) for k in ("val_top1", "val_top5", "val_loss")}, "val_epoch": evaluated.get("epoch"),
                "train_loss": self.history[-1].get("train_loss") if self.history else None,
                "steps": steps, "epochs": round(steps / self.per_epoch, 3),  # 1.5 of trainer.epochs=1.5
                # the training of every epoch to the newest, through resumes
                "images_per_s": round(trained["images"] / trained["train_s"], 1) if trained["train_s"] else None,
                "train_s": round(trained["train_s"], 3), "setup_s": round(self.setup_s, 3),
                "setup_parts_s": self.setup_parts,
                # this process's first training step to its last evaluation result: the time to accuracy
                "train_and_eval_s": None if result_seconds is None else round(result_seconds, 3),
                "wall_s": round(self.clock(), 3), "time_to_first_step_s": self.first_step_s,
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                "world_size": self.dist.world, "graphs": self.executor.use_graphs,
                # this rank's arena (the plan: a share of the optimizer state under dist.shard_optimizer)
                # and its peak of torch's allocations on the device (arena, activations, workspaces)
                "arena_bytes": self.arena.plan.total_bytes,
                "peak_memory_bytes": torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None}

    def _trained(self) -> dict:
        """The images and seconds of training of the epochs done, with those of the runs this
        one resumes: the summary's throughput is the run's, not the last part's."""
        return {"images": self.trained_before["images"] + self.images,
                "train_s": self.trained_before["train_s"] + self.train_seconds}

    # -- helpers ----------------------------------------------------------------------------
    def _check_world(self, path, then: int | None):
        """A run resumed by another number of processes (the same global batch, as the epoch's
        length is checked) trains on, but each BatchNorm then normalizes over another share of
        the batch, so the result is not the run's own; said (`then`: None in checkpoints
        written before it was kept, 2026-12-02). A sharded optimizer state is refused as it loads."""
        if then is not None and then != self.dist.world and self.dist.is_main:
            log.warning("%s was trained by %d process(es) and this run has %d: each BatchNorm normalizes over a "
                        "rank's share of the batch, so training goes on over shares of another size and ends "
                        "otherwise than the run would have; resume with %s to go on as it was", path, then,
                        self.dist.world, processes(then))

    def _check_epoch_length(self, path, saved: int | None, examples: int | None, written: dict, world: int | None):
        """A resumed run's epochs must have the checkpoint's number of steps (`saved`; None
        in checkpoints written before it was kept): the schedule, the data order and the step
        count go by the step, so other ones would train on from the wrong point of each (the
        learning rate jumping back, epochs cut short). `examples`: the training set's size
        the checkpoint was trained on (None before it was kept), `written` its options: with
        the same data.train_size, another size is the data set's own (images added to a
        folder), which no option of the command line mends. `world`: the processes that
        trained it (None before it was kept); by another number, trainer.batch_size (a
        process's) keeps the global batch only where the command line gives it anew."""
        total = self.train_source.shard.total
        changed = examples is not None and examples != total and written.get("data.train_size") == self.cfg.data.train_size
        if saved is None or saved == self.per_epoch:
            if changed and self.dist.is_main:  # images added or removed, the epochs as long: it trains on
                log.warning("%s was trained on %d examples and this run's training set has %d: the data set changed; "
                            "the run goes on with it, in epochs of the same %d steps", path, examples, total, self.per_epoch)
            return
        if changed:
            raise ConfigError(
                f"{path} was trained in epochs of {saved} steps, and this run's have {self.per_epoch}: its training "
                f"set had {examples} examples and this run's has {total}: the data set changed; restore it, or start a "
                "new run")
        batch = written.get("trainer.batch_size")
        if world not in (None, self.dist.world) and batch is not None:
            kept = (f"give trainer.batch_size={batch * world // self.dist.world} for that global batch, or resume"
                    if batch * world % self.dist.world == 0 else "resume")
            raise ConfigError(
                f"{path} was trained by {processes(world)} at trainer.batch_size={batch} (a global batch of "
                f"{batch * world}) in epochs of {saved} steps, and this run's have {self.per_epoch} with "
                f"{processes(self.dist.world)}: {kept} with {processes(world)}")
        raise ConfigError(
            f"{path} was trained in epochs of {saved} steps, and this run's have {self.per_epoch}: "
            "trainer.batch_size, data.train_size, trainer.drop_last or the number of ranks differ from the "
            "run that wrote it; resume with its values")

    def _check_classes(self, path, written: list[str] | None):
        """The class folders' names the checkpoint was trained on (None: none kept, or a data set
        that names none) against this run's: label k is the k-th name, so a folder renamed or
        put in another's place evaluated or trained each class's images under another's label."""
        now = self.val_source.classes
        if written is None or now is None or list(written) == now:
            return
        differ = [f"label {k}: {then!r} there, {here!r} here" for k, (then, here) in enumerate(zip(written, now))
                  if then != here]
        raise ConfigError(f"{path} was trained on other class folders than {self.cfg.data.root}'s ({'; '.join(differ[:3])}"
                          f"{'; ...' if differ[3:] else ''}): its labels would name other classes; give data.root the "
                          "data set it was trained on")

    def _check_whole_epochs(self, path, steps: int | None):
        """A fractional trainer.epochs ends its run part way through the last epoch, and the
        checkpoint then holds `steps` (None in checkpoints written before they were kept). An
        epoch's steps run from its first (the data order, the step count), so a run that
        would train on cannot start inside one: it would skip the epoch's rest."""
        if steps is not None and steps < self.start_epoch * self.per_epoch and self.total_steps > steps:
            raise ConfigError(
                f"{path} ends {steps % self.per_epoch} of {self.per_epoch} steps into epoch {self.start_epoch} (its run "
                f"stopped at a fractional trainer.epochs), and a run trains on only from the end of a whole epoch: "
                + (f"continue from epoch {self.start_epoch - 1}'s checkpoint, if it is kept, in a folder of its own "
                   "(hydra.run.dir=...), or train from scratch" if self.start_epoch > 1 else "train from scratch"))

    def _check_stop(self, path) -> bool:
        """trainer.stop_after_epoch at or before the epoch a run resumes after would stop it
        only after one more epoch: the stop given again with the first command's options.
        True where torchrun restarted the job, or a sweep run again goes on with a job, after
        that stop's own checkpoint: it is done."""
        stop = self.cfg.trainer.stop_after_epoch
        if stop and stop <= self.start_epoch:
            if stop == self.start_epoch and (restart_checkpoint(self.run_dir) or swept()):  # the same command again
                return True
            raise ConfigError(f"trainer.stop_after_epoch={stop}: {path} has trained {self.start_epoch} epoch(s) "
                              f"already; give a later epoch to stop after, or leave it out to train to the end")
        return False

    def _check_schedule(self, path, then: int | None, step: int, written: dict | None):
        """Another trainer.epochs lays the schedule over another number of steps (`then`, the
        checkpoint's), and other schedule options shape it otherwise: training on, or a
        shorter run, as asked, and where the learning rate (or EMA's warm-up) moves at the resume
        point, `step`, that is said where steps are left to train; a constant rate, or a warm-up
        still climbing, stays. Its value before is the checkpoint's schedule's (`written`: its
        run's options; this run's in checkpoints written before they were kept)."""
        if then is None or step >= self.total_steps:
            return
        ours = {f.name: getattr(self.cfg.schedule, f.name) for f in fields(ScheduleConfig)}
        theirs = {name: (written or {}).get(f"schedule.{name}", value) for name, value in ours.items()}
        changed = " ".join(f"schedule.{name}={ours[name]} (was {value})" for name, value in theirs.items()
                           if value != ours[name])
        before = lr_multipliers(ScheduleConfig(**theirs), then, self.per_epoch)[min(step, then - 1)].item()
        now = lr_multipliers(self.cfg.schedule, self.total_steps, self.per_epoch)[step].item()
        ema = self._ema_warm_up_moves(then, step, written)
        if now == before and not ema:
            return
        if then == self.total_steps:
            why = f"on another schedule: this run's {changed}"
        else:
            why = f"on a schedule of {then} steps and this run's has {self.total_steps} (another trainer.epochs)" + (
                f" and {changed}" if changed else "")
        # the next step's number as its metrics row gives it, counted from 1
        lr = f"stays at {now:.3g} of its peak" if now == before else f"is {now:.3g} of its peak, where it was {before:.3g}"
        log.warning("%s was trained %s: the learning rate at step %d %s%s", path, why, step + 1, lr, ema)

    def _check_unreached(self, then: int | None, step: int, written: dict | None):
        """What a run never reaches of what its options set for later (unreached) is said as it
        starts; a resume that lays it over another length (`then`: the checkpoint's steps) or sets
        those options otherwise says what its run, of the options `written`, did not, where steps
        are left to train after `step`; not again where nothing changed (torchrun's restart). Both
        are None in checkpoints written before they were kept: this run's are taken."""
        if step >= self.total_steps:
            return
        before = copy.deepcopy(self.cfg)
        take_options(before, written or {}, RUN_OPTIONS, set())
        said = unreached(before, self.per_epoch, then or self.total_steps)
        for why in unreached(self.cfg, self.per_epoch, self.total_steps) if self.dist.is_main else []:
            if why not in said:
                log.warning("%s", why)

    def _ema_warm_up_moves(self, then: int, step: int, written: dict | None) -> str:
        """What a schedule of another length does to EMA's warm-up, which raises the decay as (step / the run's
        steps)^trainer.ema_warmup_power: at the end of a finished run the average forgot slowly, and over a run made
        longer it forgets fast again (by the checkpoint's power, `written`, before)."""
        power = self.cfg.trainer.ema_warmup_power
        if not (self.cfg.ema and power) or then == self.total_steps:
            return ""
        was = (written or {}).get("trainer.ema_warmup_power", power)
        now, before = (step / self.total_steps) ** power, (step / then) ** was
        return (f"; the EMA's decay, which warms up over the run's steps (trainer.ema_warmup_power={power:g}), is "
                f"{now:.3g} of its full value there, where it was {before:.3g}")

    def _records(self, run_dir: Path, claim: bool, enabled: bool) -> MetricsLog:
        """The run's metrics file. A training run may not write into another run's folder
        (trainer.run_dir), and a new one claims its folder by creating the file: of two runs
        that started in the same second, the second is refused."""
        new = False
        if claim and self.dist.is_main:
            why = other_run(run_dir, self.cfg.trainer.resume)
            if why:
                raise ConfigError(why)
            new = not (run_dir / RECORDS).exists()
        try:
            return MetricsLog(run_dir, enabled=enabled, log=log, new=new)
        except OSError as e:  # a folder made read-only since it was checked; a link to nowhere in the file's place
            why = other_run(run_dir, "") if isinstance(e, FileExistsError) else None
            if why:
                raise ConfigError(why) from None
            raise WriteError(f"cannot write {run_dir / RECORDS} ({e.strerror or e})", e.errno) from None

    def _first_step_done(self):
        """Time to first step: set-up, capture and one step, measured once (one sync)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.first_step_s = round(self.clock(), 3)

    def _check_finite(self, block: bool):
        """A non-finite loss stops the run: its update was skipped in the graph, so the
        weights and the last checkpoint are intact. Under AMP too: an fp16 overflow of the
        gradients alone (a finite loss) is the loss scale's business and only skips a step,
        but a non-finite loss comes from the forward pass, which no loss scale mends."""
        # the blocking check reads a fresh copy: a poll's copy still in flight may have been
        # queued many steps before the epoch's last, which it would not see
        pending = None if block else getattr(self, "_nan_future", None)
        if pending is None:
            self._nan_future = pending = self.arena.to_host_async(self.plans.main[B.NAN_SEEN])
        if not (block or pending.is_ready()):
            return
        self._nan_future = None
        if int(pending.get()[0]):
            self._diverged("the training loss became NaN or infinite; the step was skipped and training stopped")

    def _check_loss(self, loss: float):
        """An epoch's mean training loss a thousand times a uniform guess's (ln classes: a true
        class's probability under e^-2300 for ten classes) stops the run too, before its
        checkpoint: finite, but from a model that has diverged (a learning rate of 1e9 trains
        on at losses of 1e24 and chance accuracy)."""
        guess = math.log(self.cfg.model.num_classes)
        if loss > 1000 * guess:
            self._diverged(f"the epoch's training loss, {loss:.3g}, is over 1000 times a uniform guess's "
                           f"({guess:.3g}): training diverged and stopped")

    def _diverged(self, what: str):
        found = saved(self.run_dir / "checkpoints")
        raise DivergedError(
            f"{what}. " + (f"The checkpoints saved before are intact (the newest: {found[-1]}). " if found else
                           "No checkpoint was saved before it. ")
            + "Lower optimizer.lr or add a warm-up (schedule.warmup_epochs)" + (
                "; under fp16 activations beyond 65504 overflow, amp_dtype=bf16 has fp32's range."
                if self.cfg.amp and self.cfg.amp_dtype == "fp16" else "."))

    def _event(self):
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _elapsed(self, start, end) -> float:
        if self.device.type == "cuda":
            end.synchronize()
            return start.elapsed_time(end) / 1000
        return end - start
