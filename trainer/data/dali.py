"""DALI pipelines fed by an external source: the host decides the order of examples (from
the seed, per epoch, per rank); DALI decodes and augments them (on the GPU where there is
one) and the result is copied straight into the arena's input buffer."""
from collections import deque

import numpy as np
import torch
from nvidia.dali import fn, types
from nvidia.dali.pipeline import Pipeline
from nvidia.dali.plugin.pytorch import feed_ndarray

from trainer.config import DataConfig
from trainer.data.jpeg_files import decode_error, printable
from trainer.data.source import DALI_SEED, EpochPlan, Shard, flips, on, rng
from trainer.errors import DataError

# Iterations DALI works on ahead of the loop (its prefetch queue depth): enough that
# reading, decoding and augmenting overlap one another and fill() finds its batch ready.
IN_FLIGHT = 3


def gpu_id(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None  # CPU-only DALI: every operator runs on the host
    return device.index if device.index is not None else torch.cuda.current_device()


def new_pipeline(device: torch.device, threads: int, batch: int, seed: int, depth: int = 1) -> Pipeline:
    """depth: iterations in flight. DALI's first run of a pipeline starts all `depth` of them
    at once, so their inputs must all be fed before it (DaliSource._schedule does)."""
    return Pipeline(batch_size=batch, num_threads=threads, device_id=gpu_id(device), seed=seed,
                    prefetch_queue_depth=depth, exec_dynamic=True)


def decode_all(names: list[str], encoded: list[np.ndarray], threads: int, size: tuple[int, int], why: str,
               batch: int = 4096) -> torch.Tensor:
    """Decode JPEGs of one size, (height, width) `size`, once into one uint8 (N, H, W, 3)
    tensor in host memory; the first image of another size is named, with `why` it must
    have that one. The host's cores, not the GPU: nvJPEG's cost per image outweighs its
    speed for 32x32 images (CIFAR-10's 50,000 on an H200's host: 3.4 s on the GPU, 1.7 s
    on 16 cores)."""
    pipe = new_pipeline(torch.device("cpu"), threads, batch, seed=0)
    with pipe:
        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8)
        pipe.set_outputs(fn.decoders.image(jpegs, device="cpu", output_type=types.RGB))
    out = torch.empty((len(encoded), *size, 3), dtype=torch.uint8)
    for start in range(0, len(encoded), batch):
        chunk, chunk_names = encoded[start:start + batch], names[start:start + batch]
        pipe.feed_input("jpegs", chunk)
        pipe.schedule_run()
        try:
            (images,) = pipe.outputs()
        except RuntimeError as e:
            raise decode_error(chunk_names, chunk, e) from e
        # a batch that is not dense holds images of different shapes, so one is not `size`
        if not images.is_dense_tensor() or tuple(images.as_tensor().shape()[1:3]) != size:
            first = next(i for i in range(len(chunk)) if tuple(images[i].shape()[:2]) != size)
            height, width = images[first].shape()[:2]
            raise DataError(f"{printable(chunk_names[first])} is {width}x{height} pixels, but {why}")
        feed_ndarray(images.as_tensor(), out[start:start + len(chunk)])
    return out


class QueuedEpoch:
    """An epoch as a DaliSource feeds it: its order, its draws, how many batches are fed."""

    def __init__(self, epoch: int, resolution: int, plan: EpochPlan, draws: dict[str, np.ndarray]):
        self.epoch, self.resolution, self.plan, self.draws = epoch, resolution, plan, draws
        self.scheduled = 0


class DaliSource:
    """A Source whose batches come from DALI pipelines: per resolution, one pipeline for each
    part of a batch (one part, unless a subclass splits the work, as JPEG folders split
    decoding between the host and the GPU).

    Subclasses give the data: `labels` (int32 per example), `graph(resolution, augment,
    part)` (the operators from their external sources to HWC uint8 images of at least
    resolution x resolution, on the GPU where there is one) and `inputs(examples)` (what to
    feed those external sources for these examples, by name), and may add per-epoch
    augmentation draws (`draws`). Here: the order, the flips, normalization to the arena's
    dtype and layout, the copy into the arena, and in training the next epoch's first
    batches fed while this epoch's last are served.
    """

    labels: np.ndarray
    parts = 1
    classes: list[str] | None = None

    def __init__(self, shard: Shard, num_classes: int, mean, std, d: DataConfig, seed: int,
                 device: torch.device, half: torch.dtype | None, augment: bool):
        self.shard, self.size, self.num_classes = shard, shard.size, num_classes
        self.mean, self.std = [255 * m for m in mean], [255 * s for s in std]
        self.d, self.seed, self.device, self.half, self.augment = d, seed, device, half, augment
        self.gpu = device.type == "cuda"
        self._pipes: dict[int, list[Pipeline]] = {}
        self._epoch: QueuedEpoch | None = None  # the epoch fill() serves
        self._next: QueuedEpoch | None = None  # the one after it, once its first batches are fed
        self._in_flight: deque[np.ndarray] = deque()  # examples of the fed iterations, in order
        self._running: set[Pipeline] = set()  # pipelines past their first (prefetching) run

    def graph(self, resolution: int, augment: bool, part: int):
        raise NotImplementedError

    def inputs(self, examples: np.ndarray) -> dict:
        raise NotImplementedError

    def draws(self, epoch: int) -> dict[str, np.ndarray]:
        """One epoch's augmentation draws per example of the data set, fed by name beside
        inputs(): the flips here; subclasses add theirs."""
        return {"flip": flips(self.d.flip, self.shard.total, self.seed, epoch).astype(np.int32)}

    def decode_error(self, examples: np.ndarray, error: RuntimeError) -> Exception:
        return error

    def part_slices(self, n: int) -> list[slice]:
        """The rows of a batch of n that each part makes."""
        return [slice(0, n)]

    def part_threads(self, part: int) -> int:
        return self.d.threads

    def _build(self, resolution: int, augment: bool, dtype, pad: bool, part: int, depth: int = 1) -> Pipeline:
        rows = self.part_slices(max(self.shard.batches, default=1))[part]
        pipe = new_pipeline(self.device, self.part_threads(part), rows.stop - rows.start,
                            int(rng(self.seed, DALI_SEED, self.shard.rank, resolution, part).integers(2**31)), depth)
        with pipe:
            images = self.graph(resolution, augment, part)
            mirror = fn.external_source(name="flip", dtype=types.INT32) if augment else 0
            # crop: the center resolution x resolution (a no-op where the graph made it exact)
            images = fn.crop_mirror_normalize(images, crop=(resolution, resolution), mirror=mirror,
                                              mean=self.mean, std=self.std, dtype=dtype,
                                              output_layout="HWC", pad_output=pad)
            labels = fn.external_source(name="labels", dtype=types.INT32)
            mask = fn.external_source(name="mask", dtype=types.INT8)
            if self.gpu:
                labels, mask = labels.gpu(), mask.gpu()
            pipe.set_outputs(images, labels, mask)
        pipe.build()
        return pipe

    def _feed(self, pipe: Pipeline, examples: np.ndarray, real: np.ndarray, draws: dict[str, np.ndarray]) -> None:
        feeds = self.inputs(examples)
        feeds["labels"] = self.labels[examples]
        feeds["mask"] = real.astype(np.int8)
        feeds.update((name, per_example[examples]) for name, per_example in draws.items())
        for name, value in feeds.items():
            pipe.feed_input(name, value)

    def _queue(self, epoch: int, resolution: int) -> QueuedEpoch:
        if resolution not in self._pipes:
            # fp16 goes straight into the arena (4 channels, the 4th zero); DALI has no
            # bfloat16, so bf16 takes an fp16 detour through a staging tensor in fill().
            dtype = types.FLOAT16 if self.half is not None else types.FLOAT
            # every epoch at one resolution has as many batches as this one: the first run's
            # prefetch never waits for more than an epoch holds
            depth = max(1, min(IN_FLIGHT, len(self.shard.batches)))
            self._pipes[resolution] = [self._build(resolution, self.augment, dtype, self.half is not None, part, depth)
                                       for part in range(self.parts)]
        return QueuedEpoch(epoch, resolution, self.shard.epoch(self.seed, epoch),
                           self.draws(epoch) if self.augment else {})

    def start_epoch(self, epoch: int, resolution: int) -> None:
        ahead = self._next
        if ahead is not None and (ahead.epoch, ahead.resolution) == (epoch, resolution) \
                and len(self._in_flight) == ahead.scheduled:
            self._epoch = ahead  # its first batches were fed while the last epoch's were served
        else:
            # An epoch left unfinished (a fractional last epoch), or batches fed ahead for
            # an epoch that is not this one, leave iterations in flight: collect them, or
            # this epoch would begin with their batches.
            while self._in_flight:  # all at the last epoch's resolution
                examples = self._in_flight.popleft()
                for pipe, rows in zip(self._pipes[self._epoch.resolution], self.part_slices(len(examples))):
                    self._outputs(pipe, examples[rows])
            self._epoch = self._queue(epoch, resolution)
        self._next = None
        while len(self._in_flight) < IN_FLIGHT and self._epoch.scheduled < len(self._epoch.plan):
            self._schedule(self._epoch)

    def _schedule(self, queued: QueuedEpoch) -> None:
        span = queued.plan.span(queued.scheduled)
        examples, real = queued.plan.examples[span], queued.plan.real[span]
        self._in_flight.append(examples)
        queued.scheduled += 1
        for pipe, rows in zip(self._pipes[queued.resolution], self.part_slices(len(examples))):
            self._feed(pipe, examples[rows], real[rows], queued.draws)
            if pipe in self._running:
                pipe.schedule_run()
            elif len(self._in_flight) == pipe.prefetch_queue_depth:
                pipe.schedule_run()  # the first run: starts every fed iteration
                self._running.add(pipe)

    def _outputs(self, pipe: Pipeline, examples: np.ndarray, stream=None) -> tuple:
        """The pipeline's next iteration, made of `examples`; where DALI fails on one of them (a
        damaged file data.check_files=false let through), a message naming it."""
        try:
            return pipe.outputs(cuda_stream=stream)
        except RuntimeError as e:
            raise self.decode_error(examples, e) from e

    def fill(self, data: torch.Tensor, label: torch.Tensor, mask: torch.Tensor | None, stream) -> None:
        if not data.is_contiguous():
            raise ValueError(f"fill() writes raw NHWC bytes: data must be contiguous, not strides {data.stride()}")
        self._epoch.plan.take(len(data))
        examples = self._in_flight.popleft()
        stream = stream if self.gpu else None
        for pipe, rows in zip(self._pipes[self._epoch.resolution], self.part_slices(len(data))):
            # bound to `stream`: the copies below wait for DALI on the device, not the host
            images, labels, masks = self._outputs(pipe, examples[rows], stream)
            with on(stream, data):
                if data.dtype == torch.bfloat16:
                    staging = torch.empty(data[rows].shape, dtype=torch.float16, device=data.device)
                    feed_ndarray(images.as_tensor(), staging, cuda_stream=stream)
                    data[rows].copy_(staging)
                else:
                    feed_ndarray(images.as_tensor(), data[rows], cuda_stream=stream)
                feed_ndarray(labels.as_tensor(), label[rows], cuda_stream=stream)
                if mask is not None:
                    feed_ndarray(masks.as_tensor(), mask[rows], cuda_stream=stream)
        # its slot in DALI's queues is free again: start the iteration after the last in flight
        if self._epoch.scheduled < len(self._epoch.plan):
            self._schedule(self._epoch)
        elif self.augment:
            # Training: the next epoch's first batches, at this resolution, so that it does
            # not begin with the device waiting for DALI's first iteration. Should the next
            # epoch differ (progressive resizing, or none), start_epoch() collects them.
            if self._next is None:
                self._next = self._queue(self._epoch.epoch + 1, self._epoch.resolution)
            if self._next.scheduled < len(self._next.plan):
                self._schedule(self._next)

    def peek(self, n: int) -> torch.Tensor:
        pipe = self._build(self.d.resolution, False, types.FLOAT, pad=False, part=self.parts - 1)
        examples = self.shard.order(self.seed, 0)[:n] % self.shard.total
        out = torch.empty((len(examples), self.d.resolution, self.d.resolution, 3), device=self.device)
        step = pipe.max_batch_size
        for start in range(0, len(examples), step):
            chunk = examples[start:start + step]
            self._feed(pipe, chunk, np.ones(len(chunk), bool), draws={})
            pipe.schedule_run()
            images = self._outputs(pipe, chunk)[0]
            feed_ndarray(images.as_tensor(), out[start:start + len(chunk)])
        return out.permute(0, 3, 1, 2).contiguous()
