"""The Hydra entry in plan mode: `python run.py mode=plan ...` prints the region map and writes
plan.json, whose shape other tools rely on; bad input exits non-zero with one message."""
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_py
from trainer.regions import Region

SIX = ("BN_BIAS", "BN_WEIGHT", "FC_BIAS", "FC_WEIGHT", "FIRST_CONV", "DEEP_CONV")
HALF = ("FC_WEIGHT", "FIRST_CONV", "DEEP_CONV")
W_EQ = {"W_EQ_BIAS", "W_EQ_SCALE"}
E32, E16 = {f"E_{k}" for k in SIX}, {f"E_{k}_FP16" for k in HALF}
AMP_ONLY = {f"A_{k}" for k in HALF} | {f"G_{k}_FP16" for k in HALF} | {
    "S_SCALAR_FP16", "F_FEATURE_FP16", "F_GRAD_SLOT_FP16"}
# under AMP the weight block's gradients are only their half twins (docs/DESIGN.md, "As built")
FP32_ONLY = {"F_FEATURE_FP32", "F_GRAD_SLOT_FP32"} | {f"G_{k}" for k in HALF}
M, V, N = {f"M_{k}" for k in SIX}, {f"V_{k}" for k in SIX}, {f"N_{k}" for k in HALF}

# name -> (overrides, the regions the design's table disables for that configuration)
CONFIGS = {
    "lars_amp_ema": (["optimizer=lars", "amp=true", "ema=true"], W_EQ | V | FP32_ONLY),
    "sgd_fold_partial": (["model=cifar_resnet20_narrow", "optimizer=sgd", "amp=false", "fold_bn=true", "trainer.batch_size=100",
                          "trainer.drop_last=false"], E32 | E16 | AMP_ONLY | M | V | N),
    "adam_amp": (["optimizer=adam", "amp=true"], W_EQ | E32 | E16 | N | FP32_ONLY),
    "resnet50_lars_amp_ema": (["model=resnet50", "optimizer=lars", "amp=true", "ema=true"],
                              W_EQ | V | FP32_ONLY),
}
DTYPES = {"fp32", "fp16", "int32", "int8"}
# one rank of a job of four processes, planned from a single one
SHARDED = ["optimizer=adamw", "dist.shard_optimizer=true", "dist.plan_ranks=4"]


def run_plan(run_dir: Path, *overrides) -> subprocess.CompletedProcess:
    return run_py(["mode=plan", *overrides, f"hydra.run.dir={run_dir}"], ROOT, env={"HYDRA_FULL_ERROR": None})


# Bad input: overrides, what the message must name, whether it is the app's own one-line message
BAD = {
    # before Hydra, whose messages took five to fifteen lines (its search path, HYDRA_FULL_ERROR)
    "unknown-optimizer-group": (["optimizer=foo"], "optimizer=foo: conf/optimizer/ has no foo.yaml; choose one of "
                                                   "adam, adamw, lars, momentum, muon, nesterov, sgd", True),
    "misspelled-experiment": (["+experiment=cifar10"], "+experiment=cifar10: conf/experiment/ has no cifar10.yaml; "
                                                       "choose one of cifar10_resnet18, cifar10_speed, cifar10_speed_sgd "
                                                       "(did you mean +experiment=cifar10_speed?)", True),
    "not-a-bool": (["amp=maybe"], "amp=maybe: Value 'maybe' is not a valid bool (type str)", True),
    "not-a-number": (["optimizer.lr=abc"], "optimizer.lr=abc: Value 'abc' of type 'str' could not be converted to "
                                           "Float", True),
    "not-an-integer-in-a-list": (["model.widths=[64,x]"], "model.widths=[64,x]: Value 'x' of type 'str' could not be "
                                                          "converted to Integer", True),
    # before Hydra, whose message advised +trainer.bach_size=3, which the schema refuses as well
    "misspelled-key": (["trainer.bach_size=3"], "trainer.bach_size: the configuration has no such key "
                                                "(trainer/config.py lists every one); did you mean trainer.batch_size?", True),
    "misspelled-key-added": (["+trainer.epoch=3"], "+trainer.epoch: the configuration has no such key "
                                                   "(trainer/config.py lists every one); did you mean trainer.epochs?", True),
    "unknown-key": (["trainer.zzzz=3"], "trainer.zzzz: the configuration has no such key (trainer/config.py lists "
                                        "every one); check its spelling", True),
    # Hydra's seven lines on a key "not in struct", exit 1
    "compile-option-without-plus": (["compile=true", "compile_options.max_autotune=true"],
                                    "compile_options.max_autotune=true: compile_options starts empty, and takes an "
                                    "inductor option given with a + in front (+compile_options.max_autotune=true)", True),
    # an interpolation that resolves to nothing ended in OmegaConf's traceback
    "interpolation-of-nothing": (["trainer.epochs=${data.foo}"], "trainer.epochs: Interpolation key 'data.foo' not "
                                                                 "found", True),
    # DALI aborted the process when it could not start them (exit 134, no message)
    "threads-beyond-any-host": (["data.threads=100000"], "data.threads=100000: at most 1024 threads a rank", True),
    # plan and bench plan the options given: a checkpoint named was ignored without a word
    "plan-of-a-checkpoint": (["trainer.resume=/nowhere"], "trainer.resume=/nowhere is read by mode=train", True),
    "negative-batch-size": (["trainer.batch_size=-3"], "trainer.batch_size=-3", True),
    "host-decode-share-above-one": (["data.host_decode=1.5"], "data.host_decode=1.5 must lie in [0, 1]", True),
    "muon-without-a-schedule-peak": (["optimizer=muon", "optimizer.lr=0"], "optimizer=muon with optimizer.lr=0", True),
    "learning-rate-not-a-number": (["optimizer.lr=nan"], "optimizer.lr=nan must be a finite number", True),
    "plan-ranks-in-a-training-run": (["mode=train", "dist.plan_ranks=4"], "dist.plan_ranks=4 only applies to mode=plan",
                                     True),
    # found as the model was planned: a sweep's job, after the jobs before it had run
    "fold-bn-of-a-fast-net": (["fold_bn=true"], "fold_bn=true folds each BatchNorm's weight into its scale, and "
                                                "model=fastnet's BatchNorms learn only their bias: use fold_bn=false, "
                                                "or a ResNet", True),
    # finite, and so past the checks, then a traceback as the set-up made fp32 scalars or int64 step counts of them
    "beyond-fp32": (["optimizer.weight_decay=1e300"], "optimizer.weight_decay=1e+300 is too large: fp32 holds at most "
                                                      "3.4e+38", True),
    "epochs-beyond-any-run": (["schedule.warmup_epochs=1e300"], "schedule.warmup_epochs=1e+300 is too large: at most "
                                                                "1e+12 epochs", True),
    # Hydra's seven lines, or its traceback ("must be a string or a list"), exit 1
    "a-key-deleted": (["~trainer.epochs"], "~trainer.epochs: a key of trainer cannot be removed; give it another "
                                           "value instead (trainer.epochs=...)", True),
    "a-group-deleted": (["~model"], "~model: a run needs its model; choose another with model=... (one of conf/model/)",
                        True),
    "a-group-of-null": (["model=null"], "model=null: choose one of cifar_resnet20, ", True),
    # every step of the weight block zero: a finished run at chance, without a word
    "lars-without-trust": (["optimizer=lars", "optimizer.lars_eta=0"], "optimizer.lars_eta=0.0 must be positive", True),
    "loss-scale-below-one": (["amp=true", "trainer.grad_scale_init=1e-6"], "trainer.grad_scale_init=1e-06 must be at "
                                                                           "least 1: fp16 gradients scaled down "
                                                                           "underflow to zero", True),
    # torch warned of zero-element tensors and the message blamed the image size; no groups planned silently
    "fast-net-group-of-no-channels": (["model.widths=[0,1]"], "model.widths=[0, 1]: model=fastnet needs one or more groups, "
                                      "each of a positive number of channels", True),
    "fast-net-of-no-groups": (["model.widths=[]"], "model.widths=[]: model=fastnet needs one or more groups", True),
    "cifar-resnet-of-no-blocks": (["model=cifar_resnet20", "model.depth=2"],
                                  "model.depth=2: model=cifar_resnet's depth is 6n+2 for n >= 1", True),
    "cifar-resnet-negative-depth": (["model=cifar_resnet20", "model.depth=-4"],
                                    "model.depth=-4: model=cifar_resnet's depth is 6n+2 for n >= 1", True),
    "cifar-resnet-of-no-channels": (["model=cifar_resnet20", "model.width=0"],
                                    "model.width=0: model=cifar_resnet needs a positive number of channels", True),
    # nan failed the comparisons and was called negative
    "step-factor-not-a-number": (["schedule.gamma=nan"], "schedule.gamma=nan is not a number", True),
    # the learning rate climbed to 576x its peak (power=-2), or turned nan and the message blamed optimizer.lr
    "poly-power-negative": (["schedule=poly", "schedule.power=-2"], "schedule.power=-2.0 must be positive", True),
    # the loss is 0 whatever the weights and top-1 1.0: nothing trains, and the results say all is well
    "one-class": (["data.num_classes=1"], "data.num_classes=1: a classifier needs at least 2 classes", True),
    # fewer logits than classes: an index error in the loss; more: logits no label has, trained without a word
    "model-classes-not-the-datas": (["model.num_classes=3"], "model.num_classes=3 with data.num_classes=10: the model "
                                                             "has a logit for each of the data's classes", True),
    "milestone-not-a-number": (["schedule=step", "schedule.milestones=[0.5,nan]"],
                               "schedule.milestones=[0.5, nan]: nan is not a number of epochs", True),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every command of this file run once: name -> (its run, plan.json or None)."""
    def one(name):
        run_dir = tmp_path_factory.mktemp(name)
        proc = run_plan(run_dir, *({**CONFIGS, **BAD}[name][0] if name != "sharded" else SHARDED))
        path = run_dir / "plan.json"
        return proc, json.loads(path.read_text()) if path.exists() else None
    return {name: one(name) for name in [*CONFIGS, *BAD, "sharded"]}


def finished(runs, name):
    proc, plan = runs[name]
    assert proc.returncode == 0, proc.stderr
    assert plan is not None, "no plan.json in the run directory"
    return proc, plan


@pytest.mark.parametrize("name", CONFIGS)
def test_plan_json_shape(runs, name):
    _, plan = finished(runs, name)
    assert set(plan) == {"total_bytes", "fingerprint", "config", "variants", "regions"}
    assert isinstance(plan["total_bytes"], int) and re.fullmatch(r"[0-9a-f]{8,}", plan["fingerprint"])
    assert isinstance(plan["config"], dict)
    assert plan["variants"] and all(set(v) == {"name", "batch", "resolution"} for v in plan["variants"])
    assert plan["variants"][0]["name"] == "train_base"

    regions = plan["regions"]
    assert [(r["index"], r["name"]) for r in regions] == [(int(r), r.name) for r in Region]
    assert len(regions) == 68
    cursor, ids = 0, []
    for r in regions:
        assert set(r) == {"index", "name", "enabled", "base_offset", "bytes", "tensors"}
        assert r["base_offset"] == cursor, r["name"]  # regions in order, packed
        if not r["enabled"]:
            assert r["bytes"] == 0 and r["tensors"] == [], r["name"]
        assert r["bytes"] == sum(t["slot_bytes"] for t in r["tensors"])
        assert len({t["dtype"] for t in r["tensors"]}) <= 1, r["name"]
        for t in r["tensors"]:
            assert set(t) == {"id", "name", "shape", "dtype", "offset", "slot_bytes"}
            assert t["dtype"] in DTYPES
            assert t["offset"] == cursor and t["offset"] % 256 == 0 and t["slot_bytes"] % 256 == 0
            assert t["shape"] and all(isinstance(s, int) and s > 0 for s in t["shape"])
            cursor += t["slot_bytes"]
            ids.append(t["id"])
    assert plan["total_bytes"] == cursor
    assert sorted(ids) == list(range(len(ids)))


@pytest.mark.parametrize("name", CONFIGS)
def test_enabled_regions_and_config(runs, name):
    _, plan = finished(runs, name)
    overrides, disabled = CONFIGS[name]
    assert {r["name"] for r in plan["regions"] if not r["enabled"]} == disabled
    set_ = dict(o.split("=") for o in overrides)
    config = plan["config"]
    assert config["optimizer"] == set_["optimizer"]
    assert config["amp"] == (set_.get("amp") == "true")
    assert config["ema"] == (set_.get("ema") == "true")
    assert config["fold_bn"] == (set_.get("fold_bn") == "true")


def expected_dtype(region: str, amp: bool) -> str:
    if region in ("I_A_DATA", "I_B_DATA"):
        return "fp16" if amp else "fp32"  # the first conv reads AMP input without a cast
    if region in ("I_A_LABEL", "I_B_LABEL", "S_SCALAR_INT32", "T_TEMP_INT32", "R_PREDICTED_LABEL"):
        return "int32"
    if region in ("S_SCALAR_INT8", "S_MASK", "T_TEMP_INT8"):
        return "int8"
    return "fp16" if region.startswith("A_") or region.endswith("FP16") else "fp32"


@pytest.mark.parametrize("name", CONFIGS)
def test_dtypes_per_region(runs, name):
    _, plan = finished(runs, name)
    for r in plan["regions"]:
        for t in r["tensors"]:
            assert t["dtype"] == expected_dtype(r["name"], plan["config"]["amp"]), (r["name"], t["name"])


@pytest.mark.parametrize("name", CONFIGS)
def test_prints_the_region_table(runs, name):
    proc, plan = finished(runs, name)
    for r in plan["regions"]:
        row = (rf"^\s*{r['index']}\s+{r['name']}\s+{'yes' if r['enabled'] else 'no'}\s+{len(r['tensors'])}"
               rf"\s+{r['bytes']:,}\s+{r['base_offset']:,}\s*$")
        assert re.search(row, proc.stdout, re.M), f"no table row for {r['name']}: {row}"
    assert f"{plan['total_bytes']:,}" in proc.stdout and plan["fingerprint"] in proc.stdout


def test_variants_of_a_partial_last_batch(runs):
    # synthetic data: 4096 training and 1024 evaluation examples at 16x16; batch 100 keeps
    # 4096 % 100 = 96 as a last training batch and 1024 % 100 = 24 as a last evaluation batch
    _, plan = finished(runs, "sgd_fold_partial")
    assert plan["variants"] == [
        {"name": "train_base", "batch": 100, "resolution": 16}, {"name": "train_last", "batch": 96, "resolution": 16},
        {"name": "val_base", "batch": 100, "resolution": 16}, {"name": "val_last", "batch": 24, "resolution": 16}]
    data = {r["name"]: r["tensors"] for r in plan["regions"]}["I_A_DATA"]
    assert [t["shape"] for t in data] == [[100, 16, 16, 3]]


def test_resnet50_plan(runs):
    _, plan = finished(runs, "resnet50_lars_amp_ema")
    count = {r["name"]: len(r["tensors"]) for r in plan["regions"]}
    for family in ("W", "M", "E"):
        assert (count[f"{family}_FIRST_CONV"], count[f"{family}_DEEP_CONV"], count[f"{family}_BN_WEIGHT"],
                count[f"{family}_FC_WEIGHT"], count[f"{family}_FC_BIAS"]) == (1, 52, 53, 1, 1), family
    for family in ("A_{}", "G_{}_FP16", "E_{}_FP16", "N_{}"):
        assert [count[family.format(k)] for k in HALF] == [1, 1, 52], family
    assert count["B_NEXT_MEAN"] == count["B_PREV_VAR"] == 53

    # the fp32 weight range and its fp16 twin line up element for element in the file too
    by_name = {r["name"]: r for r in plan["regions"]}
    for wide, narrow in ((("W_FC_WEIGHT", "W_FIRST_CONV", "W_DEEP_CONV"), ("A_FC_WEIGHT", "A_FIRST_CONV", "A_DEEP_CONV")),
                         (("E_FC_WEIGHT", "E_FIRST_CONV", "E_DEEP_CONV"),
                          ("E_FC_WEIGHT_FP16", "E_FIRST_CONV_FP16", "E_DEEP_CONV_FP16"))):
        ws = [t for n in wide for t in by_name[n]["tensors"]]
        hs = [t for n in narrow for t in by_name[n]["tensors"]]
        w0, h0 = by_name[wide[0]]["base_offset"], by_name[narrow[0]]["base_offset"]
        assert len(ws) == len(hs) == 54
        for w, h in zip(ws, hs):
            assert w["shape"] == h["shape"] and (w["offset"] - w0) == 2 * (h["offset"] - h0), w["name"]


def test_one_rank_of_a_sharded_job_holds_its_share_of_the_moments(runs):
    proc, plan = finished(runs, "sharded")
    s = plan["sharding"]
    assert plan["config"]["shards"] == s["shards"] == 4
    assert s["bytes_per_gpu"] < 0.3 * s["replicated_bytes"] and s["saved_bytes_per_gpu"] > 0
    assert "optimizer state sharded over 4 ranks" in proc.stdout
    assert f"{s['bytes_per_gpu']:,} bytes a GPU where replicated it takes {s['replicated_bytes']:,}" in proc.stdout
    assert f"the arena is {s['arena_saved_bytes']:,} bytes smaller" in proc.stdout


def test_fingerprints_differ_between_configurations(runs):
    prints = [finished(runs, name)[1]["fingerprint"] for name in CONFIGS]
    assert len(set(prints)) == len(prints)


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_message_without_traceback(runs, name):
    proc, plan = runs[name]
    _, needle, own_message = BAD[name]
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in output
    assert needle in output, output
    if own_message:  # the app's error: said once, on one line, not echoed a second time
        assert sum(needle in line for line in output.splitlines()) == 1, output
    assert plan is None


def test_an_infinite_step_factor_is_accepted():
    """schedule.gamma=inf is how a test makes a run's loss blow up on purpose; only nan is refused."""
    from trainer.config import compose_config
    assert compose_config(["schedule=step", "schedule.milestones=[1]", "schedule.gamma=inf"]).schedule.gamma == float("inf")


@pytest.mark.parametrize("overrides, said", [
    (["ema_decay=0.9"], ["ema_decay=0.9 has no effect: it is read only with ema=true"]),
    (["ema=true", "ema_decay=0.9"], []),
    (["schedule=cosine", "schedule.gamma=0.5", "schedule.power=3"],
     ["schedule.gamma=0.5 has no effect: it is read only with schedule=step",
      "schedule.power=3.0 has no effect: it is read only with schedule=poly"]),
    (["amp=true", "amp_dtype=bf16", "trainer.grad_scale_init=1024"],
     ["trainer.grad_scale_init=1024.0 has no effect: it is read only with amp=true and amp_dtype=fp16 (dynamic loss "
      "scaling)"]),
    (["model=resnet50", "model.depth=56", "optimizer=adamw", "optimizer.lars_eta=0.01"],
     ["optimizer.lars_eta=0.01 has no effect: it is read only with optimizer=lars",
      "model.depth=56 has no effect: it is read only with a cifar_resnet model (model=cifar_resnet20 ...)"]),
    (["data=imagefolder", "data.root=/data", "data.crop_padding=8", "data.val_resize=1.5"],
     ["data.crop_padding=8 has no effect: it is read only with data=cifar10 or synthetic (small images)"]),
    (["bench.steps=5"], ["bench.steps=5 has no effect: it is read only with mode=bench"]),
    (["mode=bench", "bench.steps=5"], []),
])
def test_options_this_configuration_does_not_read_are_named(overrides, said):
    """An option that only another configuration reads (a sweep crossing ema=true,false with
    ema_decay, a misremembered schedule key) would be ignored without a word; the run says
    so before it trains."""
    from trainer.config import compose_config, ignored
    assert ignored(compose_config(overrides)) == said


def test_the_options_mode_plan_does_not_read_are_said_and_change_no_plan(tmp_path):
    """mode=plan given ema_decay, optimizer.lr, schedule=step or trainer.seed (a sweep's, or a
    training command with mode=plan added) said nothing: each is named once, as written, and the
    plan is the one without them; the options the plan reads are named by none."""
    read = ["ema=true", "optimizer=lars", "amp=true", "trainer.epochs=3", "trainer.batch_size=64"]
    unread = ["ema_decay=0.9", "optimizer.lr=0.5", "schedule=step", "schedule.gamma=0.5", "trainer.seed=3",
              "trainer.label_smoothing=0.1", "trainer.checkpoint_every=2", "data.flip=none", "graphs=false"]
    plain = run_plan(tmp_path / "plain", *read)
    assert plain.returncode == 0 and "WARNING" not in plain.stdout + plain.stderr, plain.stdout + plain.stderr
    out = run_plan(tmp_path / "given", *read, *unread)
    printed = out.stdout + out.stderr
    assert out.returncode == 0 and printed.count("has no effect") == len(unread), printed
    for option in unread:
        assert f"WARNING] - {option} has no effect with mode=plan: it lays out the arena and runs nothing" in printed
    plans = [json.loads((tmp_path / name / "plan.json").read_text()) for name in ("plain", "given")]
    assert plans[0] == plans[1]


@pytest.mark.parametrize("group", ["model", "optimizer", "schedule", "data", "experiment"])
def test_no_group_file_sets_what_its_choice_does_not_read(group):
    """Each group file sets only options its own choice reads, so choosing it alone is said
    nothing about."""
    from trainer.config import compose_config, ignored
    for path in sorted((ROOT / "conf" / group).glob("*.yaml")):
        choice = f"+experiment={path.stem}" if group == "experiment" else f"{group}={path.stem}"
        cfg = compose_config([choice, "mode=plan"])  # plan: no data.root needed
        cfg.mode = "train"  # judged as training, which reads what plan does not (the schedule's options)
        assert ignored(cfg) == [], choice


@pytest.mark.parametrize("override", ["schedule.milestones.1=50", "model.widths.0=16", "+experiment=cifar10_speed",
                                      "~ema", "++trainer.epochs=3", "model@other=resnet50", "hydra/launcher=basic",
                                      "--config-name=train", "-m", "+compile_options.mode=max-autotune", "data=cifar10",
                                      "bench.baselines=[eager_bf16]", "hydra.run.dir=x", "trainer.epochs=3",
                                      "model=resnet50.yaml"])
def test_overrides_of_keys_the_configuration_has_pass_to_hydra(override):
    """The check of unknown keys before Hydra leaves every form of override Hydra takes for a
    key the configuration has: an item of a list, a group choice, an addition or deletion."""
    from trainer.config import refused_override
    assert refused_override([override]) is None


@pytest.mark.parametrize("folder", [["--config-dir", "/mine"], ["-cd", "/mine"], ["hydra.searchpath=[file:///mine]"]])
def test_a_group_option_from_another_folder_of_configs_is_left_to_hydra(folder):
    """Hydra finds group options in a folder the command line adds: they are not refused
    for being absent from conf/."""
    from trainer.config import refused_override
    assert refused_override([*folder, "model=mine"]) is None
    assert refused_override(["model=mine"]).startswith("model=mine: conf/model/ has no mine.yaml")
