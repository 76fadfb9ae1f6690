"""Checkpoints: the arena's persistent regions and state scalars, written atomically.

A checkpoint holds raw region bytes, so restoring it is bit-exact. It is accepted only by
a run of the same model, optimizer and AMP mode (IDENTITY) whose plan gives its persistent
regions the same layout (the state fingerprint); otherwise the message says which option
or region differs. Each part's bytes carry a
CRC-32, and the records beside them (the run's options, the tensors' offsets) the zip's,
so that a file damaged where its layout still reads is refused, not restored.
"""
import dataclasses
import hashlib
import json
import zipfile
import zlib
from pathlib import Path

import torch

from trainer.arena import Arena
from trainer.dtensor import ITEMSIZE
from trainer.errors import CheckpointError
from trainer.plan import Baseline, MemoryPlan
from trainer.regions import Region
from trainer.run_dir import CHECKPOINT_NAME, find_checkpoint, processes, run_folder, saved, writing

# Weights, EMA, half copies, BN statistics and optimizer moments: what training accumulates.
STATE_REGIONS = tuple(r for r in Region if r.name[0] in "BWEAMVN")
# What evaluation and export read: all but the optimizer's moments and LARS's norms, which
# the optimizer shapes and dist.shard_optimizer splits over the ranks
MODEL_REGIONS = tuple(r for r in STATE_REGIONS if r.name[0] in "BWEA")
STATE_SCALARS = (Baseline.STEP, Baseline.OPT_STEP, Baseline.GOOD_STEPS, Baseline.LOSS_SCALE)
IDENTITY = ("model", "optimizer", "amp", "amp_dtype", "ema", "fold_bn")
MODEL_IDENTITY = ("model", "amp", "amp_dtype", "ema", "fold_bn")


def identity(cfg) -> dict:
    """What a checkpoint records of the run that wrote it, to explain a refusal."""
    return {"model": cfg.model.name, "optimizer": cfg.optimizer.name, "amp": cfg.amp,
            "amp_dtype": cfg.amp_dtype, "ema": cfg.ema, "fold_bn": cfg.fold_bn}


def state_fingerprint(plan: MemoryPlan) -> str:
    rows = [(t.region.name, t.name, t.dtype, list(t.shape), t.slot_bytes)
            for r in STATE_REGIONS for t in plan.regions[r]]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def model_fingerprint(plan: MemoryPlan) -> str:
    """The model's tensors, not their slots: sharding pads some slots to split the weights."""
    rows = [(t.region.name, t.name, t.dtype, list(t.shape)) for r in MODEL_REGIONS for t in plan.regions[r]]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def save(path: Path, arena: Arena, meta: dict, per_rank: dict | None = None):
    """`per_rank`: regions whose bytes differ between ranks, every rank's bytes one after the
    other (Dist.gather_per_rank), so that one file restores every rank exactly."""
    plan, per_rank = arena.plan, per_rank or {}
    payload = {
        "fingerprint": plan.fingerprint(),
        "state_fingerprint": state_fingerprint(plan),
        "model_fingerprint": model_fingerprint(plan),
        # where each of the model's tensors lies in its region, and a rank's bytes of the region
        "offsets": {r.name: [t.offset - plan.base[r] for t in plan.regions[r]] for r in MODEL_REGIONS},
        "region_bytes": {r.name: plan.region_bytes(r) for r in MODEL_REGIONS},
        "layout": {r.name: [t.name for t in plan.regions[r]] for r in STATE_REGIONS},
        "shards": plan.config.shards,
        "meta": meta,
        "regions": {r.name: per_rank[r.name] if r.name in per_rank else _region_bytes(arena, r).cpu().clone()
                    for r in STATE_REGIONS if plan.region_bytes(r)},
        "scalars": {b.name: arena[plan[b]].cpu().clone() for b in STATE_SCALARS},
    }
    payload["checksums"] = {f"{kind}.{name}": _crc(data) for kind in ("regions", "scalars")
                            for name, data in payload[kind].items()}
    # a full disk, a lost mount: the earlier checkpoints are whole
    with writing(path, f"; the earlier checkpoints in {path.parent} are intact" if saved(path.parent) else "") as f:
        torch.save(payload, f)


def load(path: Path, arena: Arena, meta_now: dict, rank: int = 0, model_only: bool = False) -> dict:
    """Restore the arena's persistent state from `path`; of a region saved per rank, this
    rank's bytes (rank 0's when fewer ranks wrote it); returns the checkpoint's meta.
    model_only: the model's regions alone, for evaluation and export, from a checkpoint of
    any optimizer, its state sharded or not, with the BN statistics of its ranks averaged
    (checkpoints written before model fingerprints need the whole state to fit)."""
    path = find_checkpoint(path)
    payload = read(path)
    plan = arena.plan
    # the recorded options first: fp16 and bf16 weights, nesterov's and momentum's state have
    # the same layout, and restored into the other they were garbage or another optimizer's;
    # evaluation and export compare the model's options alone, whatever the checkpoint's age
    changed = _changed(payload["meta"], meta_now, model_only)
    evaluating, model_only = model_only, model_only and "model_fingerprint" in payload
    if changed or (payload["model_fingerprint"] != model_fingerprint(plan) if model_only
                   else payload["state_fingerprint"] != state_fingerprint(plan)):
        why, options_differ = ("; ".join(changed), True) if changed else _difference(payload, plan, model_only)
        raise _unfit(path, payload["meta"], why, options_differ, evaluating)
    try:  # a file of the right layout whose parts are missing, cut short or overwritten: damaged
        _restore(payload, arena, rank, model_only)
    except (KeyError, TypeError) as e:
        raise _damaged(path, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'a part is missing'}") \
            from None
    except _Damaged as e:
        raise _damaged(path, str(e)) from None
    return payload["meta"]


def check_model_options(path: Path, meta: dict, meta_now: dict):
    """Evaluation's and export's refusal of a checkpoint of another model or AMP mode, by the
    options it records (`meta`, read): before the run's folder is made, which a refusal in
    load, once the run has started, left holding only its .hydra/ and run.log."""
    changed = _changed(meta, meta_now, model_only=True)
    if changed:
        raise _unfit(path, meta, "; ".join(changed), True, evaluating=True)


def check_model_tensors(path: Path, meta: dict, cfg, given: dict[str, tuple], evaluating: bool):
    """The refusal, before the run's folder is made, of the model options a command line gives
    (`given`: the checkpoint's value and this run's, by key) that give the model other tensors
    than the checkpoint's, which load refused naming a region alone: each tried on its own on
    the checkpoint's model, built on the meta device (shapes alone). Those that change no
    tensor (model.cudnn_benchmark, a fastnet's logit_scale) the command may give."""
    if not any(key.startswith("model.") for key in given):
        return
    # the checkpoint's model as its run built it, of all its model options: one this run's model does not read
    # (model.depth=21 given with model=resnet18 for a ResNet-20's) would not build it
    recorded = meta.get("config", meta.get("options", {}))
    written = {f.name: recorded.get(f"model.{f.name}", getattr(cfg.model, f.name)) for f in dataclasses.fields(cfg.model)}
    from trainer.setup import make_model  # the data flow's set-up, which the run imports anyway

    def tensors(**options) -> list:
        with torch.device("meta"):
            model = make_model(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **{**written, **options})))
        return [(name, t.shape) for name, t in model.state_dict().items()]
    checkpoints = tensors()
    # each named as a command line sets it: model.num_classes follows data.num_classes (ModelConfig)
    why = [f"{'data.num_classes' if key == 'model.num_classes' else key}: checkpoint {then!r}, this run {now!r}"
           for key, (then, now) in given.items()
           if key.startswith("model.") and tensors(**{key.removeprefix("model."): now}) != checkpoints]
    if why:
        raise _unfit(find_checkpoint(path), meta, "; ".join(why), True, evaluating)


def _unfit(path: Path, meta: dict, why: str, options_differ: bool, evaluating: bool) -> CheckpointError:
    """The refusal of a checkpoint that does not fit this run: `why`, and where it is options
    of the run (`options_differ`), which to give."""
    advice = ""
    if options_differ and ("config" in meta or evaluating and "options" in meta):
        advice = (f"; leave those options out: {'evaluation and export take' if evaluating else 'a resumed run takes'}"
                  " them from the checkpoint")
    elif options_differ:  # written before checkpoints kept their run's options
        overrides = run_folder(path) / ".hydra" / "overrides.yaml"  # where Hydra keeps the writer's command line
        listed = f" ({overrides} lists them)" if overrides.exists() else ""
        advice = f"; give the options of the run that wrote it{listed}"
    return CheckpointError(f"checkpoint {path} does not fit this run: {why}{advice}")


class _Damaged(Exception):
    """A region or scalar of a checkpoint holds fewer bytes than its layout needs, or other
    bytes than were written."""


def _crc(data: torch.Tensor) -> int:
    return zlib.crc32(data.contiguous().view(torch.uint8).numpy())


def _intact(payload: dict, kind: str, name: str) -> torch.Tensor:
    """A part of the checkpoint, checked against its CRC-32 (checkpoints written before
    they had one are taken as they are)."""
    data = payload[kind][name]
    expected = payload.get("checksums", {}).get(f"{kind}.{name}")
    if expected is not None and _crc(data) != expected:
        raise _Damaged(f"{kind[:-1]} {name} holds other bytes than were written")
    return data


def _damaged(path: Path, why: str) -> CheckpointError:
    """The message for a damaged checkpoint: how to go on from the one before it, which a
    resume from the run's folder takes once this one is out of the way."""
    found = saved(path.parent)
    earlier = found[:found.index(path)] if path in found else []
    if not earlier:
        return CheckpointError(f"{path} is damaged ({why}), and {path.parent} holds no checkpoint before it: use "
                               "another checkpoint, or start the run again in a folder of its own")
    return CheckpointError(f"{path} is damaged ({why}): move it out of {path.parent} to go on from the checkpoint "
                           f"before it, {earlier[-1].name}")


def _copy(into: torch.Tensor, data: torch.Tensor, name: str):
    if data.numel() < into.numel():
        raise _Damaged(f"{name} holds {data.numel()} values of {into.numel()}")
    into.copy_(data[:into.numel()].view(into.shape))


def _restore(payload: dict, arena: Arena, rank: int, model_only: bool):
    plan = arena.plan
    if model_only:  # tensor by tensor: the slots may lie elsewhere
        for r in MODEL_REGIONS:
            n = payload["region_bytes"][r.name]
            data = _intact(payload, "regions", r.name) if r.name in payload["regions"] else None
            if data is not None and data.numel() > n:  # every rank's BN statistics (fp32): their mean,
                data = data.view(-1, n).view(torch.float32).mean(0).view(torch.uint8)  # as ranks average them
            for t, offset in zip(plan.regions[r], payload["offsets"][r.name]):
                nbytes = t.numel * ITEMSIZE[t.dtype]
                _copy(arena.storage[t.offset:t.offset + nbytes], data[offset:], f"region {r.name}")
    for name in payload["regions"] if not model_only else ():
        region, data = _region_bytes(arena, Region[name]), _intact(payload, "regions", name)
        n = region.numel()
        _copy(region, data[(rank if rank < data.numel() // n else 0) * n:], f"region {name}")
    for name in payload["scalars"]:
        _copy(arena[plan[Baseline[name]]], _intact(payload, "scalars", name).reshape(-1), f"scalar {name}")


def read(path: Path) -> dict:
    path = find_checkpoint(path)
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive, whose directory is at its end
        raise _damaged(path, "not a whole zip archive, as torch.save writes: cut short, or another kind of file")
    _check_records(path)
    try:
        # mapped, not read: evaluation reads a checkpoint's options before loading it, and a
        # load copies only the regions it restores
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        # only the first sentence: torch's goes on with advice for its own callers (load with
        # weights_only=False, file an issue) that is wrong for a damaged or foreign file
        why = str(e).splitlines()[0].split(". ")[0] if str(e) else "unreadable"
        raise _damaged(path, f"{type(e).__name__}: {why}") from None
    if not isinstance(payload, dict) or "state_fingerprint" not in payload:
        raise CheckpointError(f"{path} is not a checkpoint written by this trainer: give one of a run's "
                              "checkpoints/epoch_N.pt, or its folder")
    missing = [key for key in ("layout", "meta", "regions", "scalars") if key not in payload]
    if missing:
        raise _damaged(path, f"it has no {', '.join(missing)}")
    named, epoch = CHECKPOINT_NAME.fullmatch(path.name), payload["meta"].get("epoch")
    if named and epoch is not None and int(named[1]) != epoch:  # a resume would write over and prune by the names
        raise CheckpointError(f"{path} was saved after epoch {epoch}, not {int(named[1])} as its name says: renamed, or "
                              f"another run's put in its place; move it out of {path.parent}")
    return payload


def _check_records(path: Path):
    """The archive's entries other than the tensors' bytes, against the CRC-32 the zip keeps
    for each: torch's loader does not check them, and a byte changed in the pickle (the run's
    options, the offsets evaluation copies from) loaded as another value. The tensors' bytes,
    the bulk of the file, are checked part by part as they are restored (_intact)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for entry in archive.infolist():
                if "/data/" not in entry.filename:
                    archive.read(entry)  # BadZipFile where the bytes do not match the entry's CRC-32
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise _damaged(path, f"its records of the run: {e}") from None


def prune(folder: Path, keep: int):
    """All but the newest `keep` checkpoints removed, and the parts of any a process killed
    mid-write (SIGKILL, the OOM killer) left, a checkpoint's size each: the run's lock on its
    folder says no other process writes there."""
    for old in [*saved(folder)[:-keep], *folder.glob("epoch_*.pt.*.part")]:
        old.unlink(missing_ok=True)


def _region_bytes(arena: Arena, region: Region) -> torch.Tensor:
    offset, nbytes = arena.plan.range(region)
    return arena.storage[offset:offset + nbytes]


def _changed(then: dict, now: dict, model_only: bool) -> list[str]:
    """The options of IDENTITY (MODEL_IDENTITY for evaluation and export) on which the
    checkpoint's run (`then`) and this one differ."""
    return [f"{k}: checkpoint {then.get(k)!r}, this run {now.get(k)!r}"
            for k in (MODEL_IDENTITY if model_only else IDENTITY) if k in then and then[k] != now.get(k)
            and (k != "amp_dtype" or then.get("amp") and now.get("amp"))]  # without AMP it says nothing


def _difference(payload: dict, plan: MemoryPlan, model_only: bool) -> tuple[str, bool]:
    """What differs between the layouts of the checkpoint and this run's plan, and whether
    it is options of the run, which the command line may have given otherwise."""
    shards = payload.get("shards", 1)
    if not model_only and shards != plan.config.shards:
        held = [f"sharded over {n} ranks" if n > 1 else "not sharded" for n in (shards, plan.config.shards)]
        # a rank's share of each moment is laid out for its number of ranks; a whole one loads in any
        how = (f"resume with {processes(shards)} and dist.shard_optimizer=true" if shards > 1
               else "resume with dist.shard_optimizer=false, by any number of processes")
        return f"its optimizer state is {held[0]}, this run's is {held[1]}: {how}", False
    for r in MODEL_REGIONS if model_only else STATE_REGIONS:
        ours = [t.name for t in plan.regions[r]]
        if payload["layout"].get(r.name) != ours:
            return f"region {r.name} holds different tensors (another model or plan)", True
    return "the tensors' shapes differ (another model width, depth or number of classes)", True
