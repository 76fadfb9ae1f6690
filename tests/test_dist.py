"""Data-parallel training on the CPU: two processes on gloo.

Per-rank BatchNorm normalizes over the rank's own batch, so N ranks at batch B/N compute
what one rank computes when each BN layer normalizes every 1/N of its batch on its own
(ghost batches); that is the one-rank reference the distributed runs must equal.

Run as a script, this file is a trainer process for the end-to-end tests (see the end).
"""
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers import assert_same_state, persistent_state  # noqa: E402
from trainer import dist  # noqa: E402
from trainer.collectives import units  # noqa: E402
from trainer.errors import CheckpointError, ConfigError, PlanError  # noqa: E402

from trainer.plan import Baseline as B  # noqa: E402
from trainer.regions import FAMILY  # noqa: E402
from trainer.regions import Region as R  # noqa: E402

WORLD = 2
BATCH = 8  # per rank
TINY = ["data.train_size=64", "data.val_size=32", f"trainer.batch_size={BATCH}", "trainer.epochs=2"]


def config(*overrides):
    from trainer.config import compose_config
    return compose_config(overrides)


def ghost_batch_norm(model: nn.Module, chunks: int) -> nn.Module:
    """Every BatchNorm normalizes each 1/chunks of a training batch on its own."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.forward = functools.partial(_ghost_forward, m, chunks)
    return model


def _ghost_forward(bn, chunks, *inputs):
    """inputs: x, and the residual where set-up gave the BatchNorm a block's residual add
    (trainer/norm.py), whose class (and so forward) set-up swaps after this hook."""
    forward = type(bn).forward
    if not bn.training:
        return forward(bn, *inputs)
    return torch.cat([forward(bn, *parts) for parts in zip(*(t.chunk(chunks) for t in inputs))])


# -- without processes ---------------------------------------------------------------------------
TORCHRUN = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "job7"}


def test_torchrun_ranks_share_one_run_directory_and_rank_0_its_log():
    assert dist.launch_overrides([], {"RANK": "0"}) == []  # not under torchrun: Hydra's own directory
    assert dist.launch_overrides([], {**TORCHRUN, "RANK": "0"}) == ["hydra.run.dir=outputs/torchrun/job7"]
    assert dist.launch_overrides([], {**TORCHRUN, "RANK": "1"}) == [
        "hydra.run.dir=outputs/torchrun/job7", "hydra.job.name=run_rank1", "hydra.output_subdir=null",
        "hydra.job_logging.root.level=WARNING"]
    assert dist.launch_overrides(["hydra.run.dir=/data/run"], {**TORCHRUN, "RANK": "0"}) == []
    static = {**TORCHRUN, "RANK": "0", "TORCHELASTIC_RUN_ID": "none"}  # --master_port: torchrun has no run id
    named = dist.launch_overrides([], static)
    assert named == dist.launch_overrides([], {**static, "RANK": "1"})[:1]  # the same for every rank and restart
    assert str(os.getppid()) in named[0]
    with pytest.raises(ConfigError, match="rdzv_id"):
        dist.launch_overrides([], {**static, "WORLD_SIZE": "16"})


def test_a_sweep_under_torchrun_is_refused_in_one_line():
    """Each rank swept on its own, in a folder of its own, and the second job ended in a
    traceback as it set up the process group again."""
    for flag in ("-m", "--multirun"):
        with pytest.raises(ConfigError, match=r"^a sweep \(-m\) does not run under torchrun"):
            dist.launch_overrides([flag, "optimizer.lr=0.1,0.2"], {**TORCHRUN, "RANK": "0"})
    assert dist.launch_overrides(["-m"], {"RANK": "0"}) == []  # one process sweeps


def test_torchrun_variables_outside_a_launched_job_leave_a_single_process(tmp_path):
    """WORLD_SIZE=2 left in a shell trained one process on half the data, RANK=1 on none
    (DALI's traceback), and malformed values ended in int()'s."""
    from tests.helpers import run_py
    from trainer.errors import ConfigError
    from trainer.run_dir import ranks
    for env in ({}, {"WORLD_SIZE": "2"}, {"RANK": "1", "LOCAL_RANK": "x"}, {"TORCHELASTIC_RESTART_COUNT": "x"}):
        assert ranks(env) == (0, 1, 0)
    assert ranks({**TORCHRUN, "RANK": "1", "LOCAL_RANK": "1"}) == (1, 2, 1)
    for wrong, key in (({"RANK": "x"}, "RANK='x'"), ({}, "RANK=''"), ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
                       ({"RANK": "0", "MASTER_PORT": ""}, "MASTER_PORT=''"),  # torch's rendezvous: a traceback
                       ({"RANK": "0", "MASTER_PORT": None}, "MASTER_PORT is not set")):
        with pytest.raises(ConfigError, match=f"^{key} in the environment, with WORLD_SIZE and MASTER_ADDR there: "
                                              "torchrun sets them; start the job with torchrun, or unset them"):
            ranks({key: value for key, value in {**TORCHRUN, **wrong}.items() if value is not None})
    stray = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_WORLD_SIZE": "0", "TORCHELASTIC_RESTART_COUNT": "x"}
    out = run_py([f"hydra.run.dir={tmp_path / 'run'}", "trainer.epochs=1", "data.train_size=256", "data.val_size=64",
                  "trainer.batch_size=32"], tmp_path, stray)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (1, 8)
    out = run_py(["mode=plan"], tmp_path, {**TORCHRUN, "RANK": "x"})
    assert (out.returncode, out.stderr.splitlines()[0][:9]) == (2, "RANK='x' "), out.stderr


def test_a_torchrun_job_that_resumes_a_run_goes_on_in_its_folder(tmp_path, monkeypatch):
    """As a single process does; a checkpoint outside any run's folder starts the job's own."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for resume in (tmp_path / "run", tmp_path / "run" / "checkpoints", tmp_path / "run" / "checkpoints" / "e.pt"):
        for rank in ("0", "1"):
            assert dist.launch_overrides([f"trainer.resume={resume}"], {**TORCHRUN, "RANK": rank})[0] == \
                f"hydra.run.dir={tmp_path / 'run'}"
    assert dist.launch_overrides([f"trainer.resume={tmp_path / 'e.pt'}"], {**TORCHRUN, "RANK": "0"}) == [
        "hydra.run.dir=outputs/torchrun/job7"]
    monkeypatch.setenv("HOME", str(tmp_path))  # in Hydra's quotes, as its grammar takes a ~
    assert dist.launch_overrides(["trainer.resume='~/run'"], {**TORCHRUN, "RANK": "0"})[0] == \
        f"hydra.run.dir={tmp_path / 'run'}"


def test_device_cuda_without_a_gpu_is_refused_and_auto_falls_back_to_the_cpu(monkeypatch):
    from trainer.errors import ConfigError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dist.device_for("auto", dist.Dist()) == torch.device("cpu")
    with pytest.raises(ConfigError, match="device=cuda, but torch finds no usable GPU here.*device=auto"):
        dist.device_for("cuda", dist.Dist())


def test_deep_conv_buckets_split_by_size_and_other_kinds_stay_whole():
    from trainer.planner import unit_sizes
    from trainer.regions import Kind
    assert unit_sizes(Kind.DEEP_CONV, [10, 10, 10, 10], 2) == [2, 2]
    assert unit_sizes(Kind.DEEP_CONV, [30, 10, 10, 10], 2) == [1, 3]
    assert unit_sizes(Kind.DEEP_CONV, [10, 10], 4) == [1, 1]
    assert unit_sizes(Kind.FIRST_CONV, [10, 10], 4) == [2]
    assert unit_sizes(Kind.FC_BIAS, [], 4) == []


@pytest.mark.parametrize("config_", [dict(optimizer="adamw", amp=True, ema=True), dict(optimizer="lars")])
def test_a_sharded_plan_holds_a_share_of_each_moment_region(config_):
    from tests.helpers import small_cnn
    from trainer.plan import PlanConfig
    from trainer.planner import build_plans
    from trainer.variants import derive_variants
    plans = [build_plans(small_cnn(4, width=24), PlanConfig(shards=shards, deep_conv_buckets=2, **config_),
                         derive_variants(64, 16, 8, 8, 8), 5).main for shards in (1, 3)]
    replicated, sharded = plans
    for r in (r for r in R if r.name.startswith(("M_", "V_")) and replicated.config.enabled(r)):
        w = FAMILY["W"][next(k for k, x in FAMILY[r.name[0]].items() if x == r)]
        shares = [t.numel for t in sharded.regions[r]]
        assert sharded.config.sharded(r) and sum(shares) * 3 == sharded.region_bytes(w) // 4
        assert all(n % 128 == 0 for n in shares)
    held = sum(sharded.region_bytes(r) for r in R if r.name.startswith(("M_", "V_")))
    assert held < 0.5 * sum(replicated.region_bytes(r) for r in R if r.name.startswith(("M_", "V_")))
    assert sharded.sharding()["bytes_per_gpu"] == held and "sharding" not in replicated.to_json()
    sharded.regions[R.M_DEEP_CONV][0].shape = (128,)  # a share that no longer tiles its range
    with pytest.raises(PlanError, match="sharding: M_DEEP_CONV"):
        sharded.validate()


# -- two ranks in this test --------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, out: Path, job: str, args: tuple):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.save(globals()[job](rank, *args), out / f"rank{rank}.pt")


def on_two_ranks(tmp_path: Path, job: str, *args) -> list:
    """job(rank, *args) in two processes, which dist.start joins into one gloo group."""
    mp.spawn(_rank_main, (free_port(), tmp_path, job, args), nprocs=WORLD)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _meet_in_the_attempts_store(rank: int, agent_port: int, restarts: tuple, late: float) -> float:
    """A rank of one attempt of a torchrun job, started as torchrun's agent starts it, with
    the agent's store; rank 0 `late` seconds after the others."""
    os.environ.update(MASTER_PORT=str(agent_port), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT=str(restarts[rank]))
    time.sleep(late if rank == 0 else 0)
    timeout = timedelta(seconds=20)
    torch.distributed.init_process_group("gloo", timeout=timeout,
                                         **dist._attempt_store(dist.Dist(rank, WORLD), timeout))
    total = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(total)
    torch.distributed.destroy_process_group()
    return total.item()


def test_the_attempts_of_a_torchrun_job_meet_in_stores_of_their_own(tmp_path):
    """torchrun's agent serves one store for the whole job, which keeps what the ranks of an
    ended attempt wrote there. The second attempt here is a change of the rendezvous'
    members: rank 0's node restarted its failed worker and counted it, rank 1's node
    restarted its well one without counting. Under prefixes per restart count they looked
    for each other under two, and rank 1 read the dead attempt's addresses; rank 0 comes
    late, so rank 1 first finds the port of the ended attempt's store."""
    agent = torch.distributed.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    for attempt, restarts in enumerate(((0, 0), (1, 0))):
        assert on_two_ranks(tmp_path, "_meet_in_the_attempts_store", agent.port, restarts, attempt * 1.0) \
            == [3.0, 3.0]


def engine(cfg, d):
    from trainer.setup import assemble
    torch.manual_seed(cfg.trainer.seed)  # as the Trainer does: the same initial weights everywhere
    e = assemble(cfg, torch.device("cpu"), d.world, grad_sync_factory=d.grad_sync_factory)
    d.prepare(e)
    return e


def global_batches(cfg, steps: int, seed: int = 0) -> list:
    g, r = torch.Generator().manual_seed(seed), cfg.data.resolution
    return [(torch.randn(WORLD * BATCH, 3, r, r, generator=g), torch.randint(0, 10, (WORLD * BATCH,), generator=g))
            for _ in range(steps)]


def train(e, batches, rank: int = 0, world: int = 1) -> list[float]:
    """Steps on this rank's part of each global batch; every step's loss."""
    t, a, losses = e.plans.tensors["train_base"].input, e.arena, []
    for x, y in batches:
        part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        a[t.data["A"]].copy_(x[part])
        a[t.label["A"]].copy_(y[part])
        a[t.mask["A"]].fill_(1)
        e.executor.run("train_base", "A")
        losses.append(e.ops.s[B.LOSS].item())
    return losses


def by_parameter(e, d, family: str) -> dict:
    """Every parameter's values in a family (W, M or V), flat; a sharded family's shares
    are gathered from all ranks first."""
    plan, params = e.arena.plan, e.plans.tensors["train_base"].params
    if family == "W" or plan.config.shards == 1:
        return {n: e.arena.view(getattr(p, family.lower()), padded=True).reshape(-1).clone() for n, p in params.items()}
    shares, whole, seen = d.gather_per_rank(e.arena), torch.zeros(e.ops.w_all.numel()), Counter()
    for u in units(plan):
        region = FAMILY[family][u.kind]
        t = plan.regions[region][seen[region]]
        seen[region] += 1
        nbytes, at = plan.region_bytes(region), t.offset - plan.base[region]
        for r in range(WORLD):
            share = shares[region.name][r * nbytes + at:][:t.numel * 4].view(torch.float32)
            whole[u.start + r * t.numel:][:t.numel] = share
    w0 = plan.base[R.W_BN_BIAS]
    return {n: whole[(p.w.offset - w0) // 4:][:p.w.numel].clone() for n, p in params.items()}


def assert_same(a: dict, b: dict, rtol: float):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=1e-6, msg=lambda m: f"{name}: {m}")


# -- two ranks step like one rank at the global batch ----------------------------------------
def _two_ranks(rank: int, overrides: list, steps: int) -> dict:
    cfg = config(*TINY, *overrides)
    d = dist.start(cfg)
    e = engine(cfg, d)
    losses = train(e, global_batches(cfg, steps), rank, WORLD)
    d.average_bn(e.ops)
    return {"losses": losses, "W": by_parameter(e, d, "W"), "b_next": e.ops.b_next.clone(),
            "b_prev": e.ops.b_prev.clone()}


@pytest.mark.parametrize("overrides, steps, tolerance", [
    (["optimizer=nesterov"], 4, 1e-4),
    # Half gradients of two half batches round unlike those of one batch: one step, to that rounding.
    (["optimizer=momentum", "amp=true", "dist.deep_conv_buckets=2"], 1, 2e-2)], ids=["fp32", "amp"])
def test_two_ranks_step_like_one_rank_at_the_global_batch(tmp_path, overrides, steps, tolerance):
    ranks = on_two_ranks(tmp_path, "_two_ranks", overrides, steps)
    cfg = config(*TINY, *overrides, f"trainer.batch_size={WORLD * BATCH}")
    alone = engine(cfg, dist.Dist())
    ghost_batch_norm(alone.model, WORLD)
    start = by_parameter(alone, dist.Dist(), "W")
    losses = train(alone, global_batches(cfg, steps))
    trained = by_parameter(alone, dist.Dist(), "W")
    for r in ranks:
        torch.testing.assert_close(r["losses"], losses, rtol=tolerance / 10, atol=0)
        for name, w in trained.items():  # off by a small fraction of what training moved
            moved = (w - start[name]).abs().max()
            assert moved > 0 and (r["W"][name] - w).abs().max() <= tolerance * moved, name
    # BN_STATS_ALLREDUCE: evaluation reads the mean of the ranks' own statistics
    assert not torch.equal(ranks[0]["b_next"], ranks[1]["b_next"])
    for r in ranks:
        torch.testing.assert_close(r["b_prev"], (ranks[0]["b_next"] + ranks[1]["b_next"]) / 2)


# -- sharded optimizer state ----------------------------------------------------------------------
SHARDED_CASES = {"momentum": ["optimizer=momentum"], "adamw": ["optimizer=adamw", "ema=true"], "lars": ["optimizer=lars"],
                 "lars_amp": ["optimizer=lars", "amp=true"]}


def _sharded_and_replicated(rank: int, folder: Path) -> dict:
    from trainer import checkpoint
    d = dist.start(config(*TINY))
    out = {}
    for case, overrides in SHARDED_CASES.items():
        families = ["W", "M"] + (["V"] if case == "adamw" else [])
        engines = {}
        for sharded in (False, True):
            cfg = config(*TINY, *overrides, f"dist.shard_optimizer={sharded}")
            e = engines[sharded] = engine(cfg, d)
            losses = train(e, global_batches(cfg, 3), rank, WORLD)
            out[case, sharded] = {"losses": losses, **{f: by_parameter(e, d, f) for f in families},
                                  "plan": e.plans.to_json()}
        if case == "adamw":  # rank 0 writes every rank's share, BN statistics and (EMA) their averages;
            # each rank resumes its own
            path, e, meta = folder / "epoch_0001.pt", engines[True], checkpoint.identity(cfg)
            per_rank = d.gather_per_rank(e.arena)
            if rank == 0:
                checkpoint.save(path, e.arena, meta, per_rank)
            torch.distributed.barrier()
            # evaluation and export read the model alone: replicated, under another optimizer
            model = engine(config(*TINY, "optimizer=nesterov", "ema=true"), d)
            checkpoint.load(path, model.arena, meta, rank, model_only=True)
            pairs = [(t, u) for r in checkpoint.MODEL_REGIONS
                     for t, u in zip(model.plans.main.regions[r], e.plans.main.regions[r], strict=True)]
            out["model_only"] = {"same": [torch.equal(model.arena[t], e.arena[u]) for t, u in pairs
                                          if not t.region.name.startswith("B_")],
                                 "bn": {t.name: (model.arena[t].clone(), e.arena[u].clone()) for t, u in pairs
                                        if t.region.name.startswith("B_")}}
            resumed = engine(cfg, d)
            checkpoint.load(path, resumed.arena, meta, rank)
            more = global_batches(cfg, 2, seed=1)
            out["resumed"] = [(train(x, more, rank, WORLD), persistent_state(x.arena)) for x in (e, resumed)]
            with pytest.raises(CheckpointError) as refused:
                checkpoint.load(path, engines[False].arena, meta, rank)
            out["refused"] = str(refused.value)
    return out


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> list:
    folder = tmp_path_factory.mktemp("sharded")
    return on_two_ranks(folder, "_sharded_and_replicated", folder)


@pytest.mark.parametrize("case", list(SHARDED_CASES))
def test_sharded_optimizer_state_equals_replicated(sharded_runs, case):
    rtol = 1e-2 if "amp" in case else 1e-5
    for run in sharded_runs:
        replicated, sharded = run[case, False], run[case, True]
        torch.testing.assert_close(sharded["losses"], replicated["losses"], rtol=rtol, atol=0)
        for family in ("W", "M", "V"):
            if family in replicated:
                assert_same(sharded[family], replicated[family], rtol)
                assert any(x.abs().max() > 0 for x in sharded[family].values()), family


def test_sharded_state_takes_a_share_of_the_memory(sharded_runs):
    run = sharded_runs[0]
    replicated, sharded = run["adamw", False]["plan"], run["adamw", True]["plan"]
    assert "sharding" not in replicated and sharded["config"]["shards"] == WORLD
    bytes_of = lambda plan, prefix: sum(r["bytes"] for r in plan["regions"] if r["name"].startswith(prefix))
    assert {r["name"] for r in sharded["regions"] if r["name"].startswith(("M_", "V_")) and r["bytes"]} \
        == set(sharded["sharding"]["sharded_regions"])
    for prefix in ("M_", "V_"):  # each rank holds half, plus a slot's spare per share
        assert bytes_of(sharded, prefix) < 0.6 * bytes_of(replicated, prefix)
    s = sharded["sharding"]
    assert s["saved_bytes_per_gpu"] == s["replicated_bytes"] - s["bytes_per_gpu"] > 0.4 * s["replicated_bytes"]


def test_a_sharded_checkpoint_resumes_every_rank_share_and_its_model_loads_in_one_process(sharded_runs):
    for run in sharded_runs:
        (losses, state), (resumed_losses, resumed_state) = run["resumed"]
        assert resumed_losses == losses
        assert_same_state(state, resumed_state)
        assert ("sharded over 2 ranks, this run's is not sharded: resume with 2 processes under torchrun and "
                "dist.shard_optimizer=true") in run["refused"]
        assert "leave those options out" not in run["refused"]  # no option of the command line differs
    for run in sharded_runs:  # the weights as they are, the BN statistics (EMA's too) averaged over the ranks
        assert len(run["model_only"]["same"]) > 4 and all(run["model_only"]["same"])
        for name, (loaded, _) in run["model_only"]["bn"].items():
            mean = (sharded_runs[0]["model_only"]["bn"][name][1] + sharded_runs[1]["model_only"]["bn"][name][1]) / 2
            torch.testing.assert_close(loaded, mean, rtol=0, atol=0)


# -- end to end: torchrun, run.py, one run directory, a killed worker ---------------------------------
E2E = ["data.train_size=128", "data.val_size=32", "trainer.epochs=2", "trainer.log_every=1"]
PER_EPOCH = 128 // (WORLD * BATCH)


def launch(run_dir: Path, *args, ranks: int = WORLD, torchrun: bool = True, env: dict | None = None,
           restarts: int = 1) -> subprocess.CompletedProcess:
    """This file as the trainer script: `ranks` processes under torchrun, or one on its own."""
    head = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--max-restarts={restarts}"] \
        if torchrun else [sys.executable]
    out = subprocess.run([*head, __file__, f"hydra.run.dir={run_dir}", *E2E, *args], capture_output=True,
                         text=True, timeout=300, cwd=run_dir.parent, env={**os.environ, **(env or {})})
    assert (out.returncode == 0) == (restarts > 0), out.stdout[-3000:] + out.stderr[-3000:]
    return out


def records(run_dir: Path) -> tuple[dict, list]:
    """The loss of every step (a repeated step: its last run) and the epoch records."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "step" in r}, [r for r in rows if "train_loss" in r]


def launch_nodes(cwd: Path, *args, job: str | None = "nodes7", gpus: bool = False, restarts: int = 0,
                 env: dict | None = None, per_node: int = 1, succeeds: bool = True) -> list[str]:
    """This file as the trainer script on two nodes of `per_node` processes each: two torchrun
    agents on this host that meet through a c10d rendezvous, as the nodes of a multi-node
    job do (`gpus`: each node sees one GPU of its own, its device 0). No hydra.run.dir: the
    nodes agree on the job's directory through its --rdzv_id (`job`; None: not given),
    cwd/outputs/torchrun/<job>. Returns each node's output, its agent's log with it."""
    head = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={per_node}",
            f"--max-restarts={restarts}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
            *([f"--rdzv_id={job}"] if job else [])]
    # one thread a process, as torchrun gives each of several processes on one node: the
    # nodes then sum in the one-node job's order
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    nodes = [subprocess.Popen([*head, __file__, *E2E, *args], cwd=cwd, stdout=subprocess.PIPE, text=True,
                              env={**env, "CUDA_VISIBLE_DEVICES": str(node)} if gpus else env,
                              stderr=subprocess.STDOUT) for node in range(2)]
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode == 0 for node in nodes] == [succeeds] * 2, "\n".join(out[-3000:] for out in outs)
    return outs


@pytest.fixture(scope="module")
def e2e(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("e2e")
    launch(root / "one", "device=cpu", f"trainer.batch_size={WORLD * BATCH}", torchrun=False,
           env={"TEST_GHOST_BN": str(WORLD)})
    launch(root / "two", "device=cpu", f"trainer.batch_size={BATCH}")
    launch_nodes(root, "device=cpu", f"trainer.batch_size={BATCH}")
    # rank 1 killed, rank 0 waiting at that step until its agent stops it to start the job again
    outs = launch_nodes(root, "device=cpu", f"trainer.batch_size={BATCH}", "dist.shard_optimizer=true",
                        job="killed", restarts=1,
                        env={"TEST_KILL_AT_STEP": str(PER_EPOCH + PER_EPOCH // 2), "TEST_RANK0_WAITS": "1",
                             "LOGLEVEL": "INFO"})  # the agents' log
    (root / "killed.log").write_text("\n".join(outs))
    return root


def test_torchrun_two_ranks_train_like_one_rank(e2e):
    one, two = e2e / "one", e2e / "two"
    (one_steps, one_epochs), (two_steps, two_epochs) = records(one), records(two)
    assert list(two_steps) == list(range(1, 2 * PER_EPOCH + 1)) == list(one_steps)
    torch.testing.assert_close(list(two_steps.values()), list(one_steps.values()), rtol=1e-4, atol=0)
    torch.testing.assert_close([e["train_loss"] for e in two_epochs], [e["train_loss"] for e in one_epochs],
                               rtol=1e-4, atol=0)
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == WORLD and summary["steps"] == 2 * PER_EPOCH
    # one directory: rank 0's records, rank 1's log of warnings and errors
    assert {p.name for p in two.iterdir()} >= {"run.log", "run_rank1.log", "metrics.jsonl", "plan.json",
                                               "summary.json", "checkpoints", ".hydra"}
    assert "epoch 2" in (two / "run.log").read_text() and (two / "run_rank1.log").read_text() == ""


def test_two_nodes_train_as_two_ranks_of_one_node_in_the_directory_their_job_id_names(e2e):
    """A multi-node job: each node's process is its node's local rank 0, and the global
    ranks (not the local ones) split the data, keep the records and the checkpoints."""
    nodes, one_node = e2e / "outputs" / "torchrun" / "nodes7", e2e / "two"
    (steps, epochs), (straight, straight_epochs) = records(nodes), records(one_node)
    assert steps == straight and [e["val_loss"] for e in epochs] == [e["val_loss"] for e in straight_epochs]
    assert json.loads((nodes / "summary.json").read_text())["world_size"] == WORLD
    assert sorted(p.name for p in (nodes / "checkpoints").iterdir()) == ["epoch_0001.pt", "epoch_0002.pt"]
    assert "epoch 2" in (nodes / "run.log").read_text() and (nodes / "run_rank1.log").read_text() == ""


def test_a_killed_worker_is_restarted_and_the_job_resumes(e2e):
    """Across two nodes: the node whose worker was killed counts the restart, the other
    restarts its well worker, as torchrun's agents do for a change of the rendezvous'
    members, without counting it. That node's worker took the job's own folder for another
    run's (and the attempts met under two names, the restart counts), and the job went on
    only where that node had a restart left to spend on the failure."""
    killed = e2e / "outputs" / "torchrun" / "killed"
    agents = (e2e / "killed.log").read_text()
    assert "new nodes from group_rank" in agents  # the uncounted restart
    assert agents.count("Worker group FAILED") == 1  # the killed worker's; its peer went on in the next attempt
    assert f"resumed from {killed}, saved after epoch 1" in (killed / "run.log").read_text()
    assert json.loads((killed / "summary.json").read_text())["steps"] == 2 * PER_EPOCH
    (steps, epochs), (straight, straight_epochs) = records(killed), records(e2e / "two")
    assert list(steps) == list(straight)
    # The sharded job, killed and resumed, ends where the uninterrupted replicated one did.
    torch.testing.assert_close(list(steps.values()), list(straight.values()), rtol=1e-4, atol=0)
    torch.testing.assert_close(epochs[-1]["val_loss"], straight_epochs[-1]["val_loss"], rtol=1e-4, atol=0)
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["epoch_0001.pt", "epoch_0002.pt"]
    # the sharded plan holds half the momentum on each rank
    sharded, replicated = (json.loads((run / "summary.json").read_text()) for run in (killed, e2e / "two"))
    assert sharded["arena_bytes"] < replicated["arena_bytes"] and sharded["peak_memory_bytes"] is None  # a CPU


def test_a_resume_by_more_ranks_names_the_batch_size_once_and_trains_on_as_the_one_process(e2e, tmp_path):
    """One process's run at batch 16 resumed by two ranks took its batch size, 16 a rank: each
    rank refused it, saying to resume with the checkpoint's values, which it had. Rank 0 says
    it now, naming the batch size that keeps the global batch; given it, the ranks train the
    second epoch as the one process did (its BatchNorm in ghost batches), step by step."""
    first, run_dir = e2e / "one" / "checkpoints" / "epoch_0001.pt", tmp_path / "run"
    out = launch(run_dir, "device=cpu", f"trainer.resume={first}", restarts=0)
    said = (f"{first} was trained by one process (without torchrun) at trainer.batch_size=16 (a global batch of 16) "
            "in epochs of 8 steps, and this run's have 4 with 2 processes under torchrun: give trainer.batch_size=8 "
            "for that global batch, or resume with one process (without torchrun)")
    assert (out.stdout + out.stderr).count(said) == 1, out.stdout[-3000:] + out.stderr[-3000:]
    launch(run_dir, "device=cpu", f"trainer.resume={first}", f"trainer.batch_size={BATCH}")
    assert "resume with one process (without torchrun) to go on as it was" in (run_dir / "run.log").read_text()
    steps, one = records(run_dir)[0], records(e2e / "one")[0]
    assert list(steps) == list(range(PER_EPOCH + 1, 2 * PER_EPOCH + 1))
    torch.testing.assert_close(list(steps.values()), [one[s] for s in steps], rtol=1e-4, atol=0)


def test_a_resume_by_fewer_ranks_names_the_batch_size_and_what_a_sharded_state_needs(e2e, tmp_path):
    """Two ranks' runs resumed by one process: the replicated one trains on with the global
    batch the refusal names, as the one process trained its second epoch; the sharded one is
    refused naming the processes and option it resumes with (it said "sharded over 1 ranks"
    of a replicated checkpoint, and to resume with "the same number of ranks")."""
    replicated, run_dir = e2e / "two" / "checkpoints" / "epoch_0001.pt", tmp_path / "run"
    out = launch(run_dir, "device=cpu", f"trainer.resume={replicated}", torchrun=False, restarts=0)
    assert "give trainer.batch_size=16 for that global batch, or resume with 2 processes under torchrun" in out.stdout
    launch(run_dir, "device=cpu", f"trainer.resume={replicated}", f"trainer.batch_size={WORLD * BATCH}", torchrun=False,
           env={"TEST_GHOST_BN": str(WORLD)})
    steps, one = records(run_dir)[0], records(e2e / "one")[0]
    assert list(steps) == list(range(PER_EPOCH + 1, 2 * PER_EPOCH + 1))
    torch.testing.assert_close(list(steps.values()), [one[s] for s in steps], rtol=1e-4, atol=0)
    sharded = e2e / "outputs" / "torchrun" / "killed" / "checkpoints" / "epoch_0001.pt"
    out = launch(tmp_path / "sharded", "device=cpu", f"trainer.resume={sharded}", f"trainer.batch_size={WORLD * BATCH}",
                 torchrun=False, restarts=0)
    assert ("its optimizer state is sharded over 2 ranks, this run's is not sharded: resume with 2 processes under "
            "torchrun and dist.shard_optimizer=true") in out.stdout


def gpu_ranks() -> int:
    return min(WORLD, torch.cuda.device_count())


def on_gpus() -> list:
    """50 steps (two epochs of 25) of the global batch on the GPUs, deterministic kernels."""
    return ["device=cuda", "graphs=true", "deterministic=true", f"data.train_size={25 * gpu_ranks() * BATCH}"]


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory) -> dict:
    """One process without torchrun at the global batch, BatchNorm in ghost batches: the
    reference of the runs on several GPUs, for fp32 (TF32 off) and AMP."""
    root, runs = tmp_path_factory.mktemp("one_gpu"), {}
    for precision, env in (("amp=false", {"TEST_FP32_CONVOLUTIONS": "1"}), ("amp=true", {})):
        run_dir = root / precision.replace("=", "_")
        launch(run_dir, *on_gpus(), precision, f"trainer.batch_size={gpu_ranks() * BATCH}", torchrun=False,
               env={"TEST_GHOST_BN": str(gpu_ranks()), **env})
        runs[precision] = records(run_dir)[0]
    return runs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision, rtol", [("amp=false", 1e-4), ("amp=true", 2e-2)], ids=["fp32", "amp"])
@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_nccl_inside_cuda_graphs_trains_like_one_process(tmp_path, one_gpu, precision, rtol, sharded):
    """torchrun on up to two GPUs (one: NCCL with a single rank), collectives captured in the
    step's graphs, against one process at the global batch, 50 steps. In fp32 the curves
    agree to float32's rounding (each process sums its gradients in another order, and cuDNN
    picks its algorithms per batch size); under AMP to fp16's."""
    ranks = gpu_ranks()
    if sharded and ranks < 2:
        pytest.skip("sharded optimizer state needs two GPUs")
    env = {"TEST_FP32_CONVOLUTIONS": "1"} if precision == "amp=false" else {}
    launch(tmp_path, *on_gpus(), precision, f"trainer.batch_size={BATCH}", f"dist.shard_optimizer={sharded}",
           ranks=ranks, env=env)
    one, many = one_gpu[precision], records(tmp_path)[0]
    assert list(many) == list(one) == list(range(1, 51))
    a, b = torch.tensor(list(many.values()), dtype=torch.float64), torch.tensor(list(one.values()), dtype=torch.float64)
    print(f"{precision}, sharded={sharded}: the largest relative difference of the 50 losses is "
          f"{((a - b).abs() / b.abs()).max():.2e}, over the first 10 {((a - b).abs() / b.abs())[:10].max():.2e}")
    torch.testing.assert_close(a, b, rtol=rtol, atol=0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["graphs"] and summary["world_size"] == ranks


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_killed_gpu_worker_is_restarted_and_the_job_ends_as_the_uninterrupted_one(tmp_path):
    """Rank 1 of two killed in the second epoch on NCCL with graphs, sharded optimizer
    state and AMP: torchrun restarts both, they resume from the first epoch's checkpoint and
    end with the uninterrupted job's every loss, to the bit; as the replicated job does (two
    ranks' sums, reduce-scattered or all-reduced, round alike; the update is elementwise)."""
    gpu = [*on_gpus(), "amp=true", f"trainer.batch_size={BATCH}"]
    straight, killed, replicated = tmp_path / "straight", tmp_path / "killed", tmp_path / "replicated"
    launch(straight, *gpu, "dist.shard_optimizer=true")
    launch(killed, *gpu, "dist.shard_optimizer=true", env={"TEST_KILL_AT_STEP": "37"})
    launch(replicated, *gpu)
    assert f"resumed from {killed}, saved after epoch 1" in (killed / "run.log").read_text()
    (steps, epochs), (straight_steps, straight_epochs) = records(killed), records(straight)
    assert steps == straight_steps and len(steps) == 50
    assert [e["val_loss"] for e in epochs] == [e["val_loss"] for e in straight_epochs]
    assert records(replicated)[0] == straight_steps
    sharded, whole = (json.loads((d / "summary.json").read_text()) for d in (killed, replicated))
    assert sharded["arena_bytes"] < whole["arena_bytes"]
    assert sharded["peak_memory_bytes"] >= sharded["arena_bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_nodes_train_as_two_gpus_of_one_node(tmp_path):
    """Two nodes of one GPU each, every node's GPU its device 0, NCCL inside the step's
    graphs: the job ends with the one-node job's every loss, to the bit."""
    gpu = [*on_gpus(), "amp=true", f"trainer.batch_size={BATCH}"]
    launch(tmp_path / "one_node", *gpu)
    launch_nodes(tmp_path, *gpu, gpus=True)
    nodes = tmp_path / "outputs" / "torchrun" / "nodes7"
    (steps, epochs), (straight, straight_epochs) = records(nodes), records(tmp_path / "one_node")
    assert steps == straight and len(steps) == 50
    assert [e["val_loss"] for e in epochs] == [e["val_loss"] for e in straight_epochs]


def test_a_rank_with_another_plan_is_refused_and_each_rank_logs_why(tmp_path):
    launch(tmp_path, "device=cpu", env={"TEST_RANK1_ARGS": "model.widths=[16,32,48]"}, restarts=0)
    for log in ("run.log", "run_rank1.log"):
        text = (tmp_path / log).read_text()
        assert "ERROR" in text and "the plan fingerprint of rank 0 is" in text and "rank 1 has" in text, log
    assert "INFO" not in (tmp_path / "run_rank1.log").read_text()


def test_a_set_up_that_fails_on_one_rank_is_named_on_rank_0(tmp_path):
    """One node without the data set: rank 0 ended in gloo's traceback from the first
    collective, and its run.log did not say why."""
    launch(tmp_path, "device=cpu", env={"TEST_RANK1_ARGS": "data=cifar10 data.root=/nonexistent/cifar"}, restarts=0)
    log = (tmp_path / "run.log").read_text()
    assert "the set-up failed on rank 1: run_rank1.log in the run's folder says why" in log and "Traceback" not in log
    assert "missing data.root /nonexistent/cifar" in (tmp_path / "run_rank1.log").read_text()


@pytest.mark.parametrize("args, said, logged", [
    (["trainer.batchsize=8"], "trainer.batchsize: the configuration has no such key", False),  # before Hydra
    (["mode=eval", "checkpoint=missing.pt"], "no checkpoint at", False),  # the callback's checks
    (["trainer.batch_size=1000"], "trainer.batch_size=1000 is larger than the 64 training examples per rank", True),
    (["mode=plan", "trainer.batch_size=1000"], "trainer.batch_size=1000 is larger than the 64 training examples per "
     "rank", True),  # no process group: each rank plans on its own
    (["mode=export", "checkpoint=missing.pt"], "mode=export copies a checkpoint's weights out in one process", False)],
    ids=["unknown_key", "callback", "set_up", "plan", "export"])
def test_a_refusal_every_rank_meets_is_said_once(tmp_path, args, said, logged):
    """Every rank said it: a user with --nproc_per_node=8 read the same line 8 times. Rank 0
    says it; another rank keeps it in its log file, where it has one by then."""
    run_dir = tmp_path / "run"
    out = launch(run_dir, "device=cpu", *args, restarts=0)
    assert (out.stdout + out.stderr).count(said) == 1, out.stdout[-3000:] + out.stderr[-3000:]
    if logged:
        assert said in (run_dir / "run.log").read_text() and said in (run_dir / "run_rank1.log").read_text()


def test_a_multi_node_job_without_its_id_is_refused_once_on_each_node(tmp_path):
    """Every rank raised SystemExit, and each node printed it once a process. The nodes
    cannot meet before the process group: each node's first rank says it."""
    outs = launch_nodes(tmp_path, "device=cpu", job=None, per_node=2, succeeds=False)
    for out in outs:
        assert out.count("a multi-node torchrun job needs --rdzv_id=JOB_ID") == 1, out[-3000:]


def test_a_refusal_of_the_options_that_rank_0_does_not_meet_is_said_by_its_rank(tmp_path):
    """Rank 1 waits for rank 0 to say a refusal of the options it presumes every rank meets,
    and, rank 0 not ending the job, says it itself."""
    out = launch(tmp_path / "run", "device=cpu", env={"TEST_RANK1_ARGS": "optimizer.lr=-1"}, restarts=0)
    assert (out.stdout + out.stderr).count("optimizer.lr=-1.0 must not be negative") == 1, out.stderr[-3000:]


def test_a_rank_that_dies_part_way_is_one_line_on_the_others_with_where_to_go_on(tmp_path):
    """Rank 1 killed in epoch 2: rank 0's collective failed with gloo's "Connection reset by
    peer" in two tracebacks that named neither what happened nor the checkpoint to go on from.
    torchrun's agent, which checks its workers every 0.1 s, also sends rank 0 SIGTERM as it
    stops the job: whichever reaches rank 0 first says where to go on, once."""
    run_dir = tmp_path / "run"
    launch(run_dir, "device=cpu", f"trainer.batch_size={BATCH}", restarts=0,
           env={"TEST_KILL_AT_STEP": str(PER_EPOCH + PER_EPOCH // 2)})
    log = (run_dir / "run.log").read_text()  # torchrun's agent adds its own traceback for the rank it lost
    assert "Traceback" not in log, log
    said = re.findall(r"ERROR\] - (rank 0 lost the job's other ranks \(.+\): one ended, or did not answer within "
                      r"dist.timeout_s; their logs \(run.log, run_rankN.log in the run's folder\) say why; to go on, |"
                      rf"terminated; )continue from epoch_0001.pt with trainer.resume={run_dir}, under torchrun with 2 "
                      "processes", log)
    assert len(said) == 1 and log.count("ERROR") == 1, log


@pytest.mark.parametrize("sent, said", [(signal.SIGTERM, "terminated"), (signal.SIGINT, "interrupted")],
                         ids=["sigterm_to_the_agent", "ctrl_c_to_every_process"])
def test_a_torchrun_job_stopped_by_a_signal_names_the_checkpoint_once_on_rank_0(tmp_path, sent, said):
    """A preemption's SIGTERM to torchrun's agent, which sends it on to each rank: the ranks
    died of it without a word, so nothing said where to continue from; now they end at once.
    Ctrl-C, which a terminal sends to every process of the job: each rank said it."""
    import time
    run_dir = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
                            "--max-restarts=0", __file__, f"hydra.run.dir={run_dir}", "device=cpu",
                            f"trainer.batch_size={BATCH}", "data.train_size=128", "data.val_size=32",
                            "trainer.epochs=1000"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    first = run_dir / "checkpoints" / "epoch_0001.pt"
    deadline = time.monotonic() + 240
    while not first.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if sent == signal.SIGTERM:
        job.send_signal(sent)
    else:
        os.killpg(job.pid, sent)
    out = job.communicate(timeout=120)[0]
    assert first.exists() and job.returncode != 0, out[-3000:]
    lines = re.findall(rf"ERROR\] - {said}; continue from (epoch_\d{{4}}.pt) with trainer.resume=(\S+), under "
                       rf"torchrun with {WORLD} processes", out)
    assert len(lines) == 1 and lines[0][1] == str(run_dir) and "Traceback" not in (run_dir / "run.log").read_text(), out
    newest = sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1]
    assert lines[0][0] == newest and said in (run_dir / "run.log").read_text()
    assert said not in (run_dir / "run_rank1.log").read_text()  # rank 0 alone says it


def test_a_rank_terminated_where_torchrun_restarts_the_job_says_so(monkeypatch):
    """torchrun's agent, restarting a job whose rank failed, stops the others with SIGTERM:
    rank 0 told the user to continue by hand, or to remove the folder of a job about to
    start again in it."""
    from trainer.app import _restarts_left
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert _restarts_left() == ("; where torchrun's agent restarts the job (2 restart(s) left, unless the agent "
                                "itself was stopped), the job goes on from its newest checkpoint by itself")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert _restarts_left() == ""


def test_every_gloo_collective_names_a_lost_rank_in_one_line(monkeypatch):
    """The checkpoint's gather and the set-up's broadcast called torch directly: a rank that
    hung there still ended the others in gloo's tracebacks."""
    from trainer import collectives
    from trainer.errors import PeerError

    def lost(*args, **kwargs):
        raise RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 10000ms for send "
                           "operation to complete. This is typically caused by ...")
    monkeypatch.setattr(collectives, "all_gather", lost)
    monkeypatch.setattr(collectives.td, "broadcast", lost)
    monkeypatch.setattr(collectives.td, "all_reduce", lost)
    comm, x = collectives.Comm(1, 2, torch.device("cpu"), "gloo"), torch.zeros(4)
    for call in (lambda: comm.gather_(torch.zeros(8), x), lambda: comm.broadcast_(x), lambda: comm.sum_(x)):
        with pytest.raises(PeerError, match=r"^rank 1 lost the job's other ranks \(Timed out waiting 10000ms for send "
                                            r"operation to complete\): one ended, or did not answer within "
                                            r"dist.timeout_s"):
            call()


def test_a_failed_evaluation_on_one_rank_saves_the_epoch_it_followed_on_every_rank(tmp_path):
    """Rank 1's share of the evaluation set fails (a damaged image): rank 0 waited for it in
    the evaluation's sums, and the epoch just trained was not saved, so a resume trained it
    again. Now every rank saves it and stops, and rank 0 names the rank that failed."""
    run_dir = tmp_path / "run"
    launch(run_dir, "device=cpu", f"trainer.batch_size={BATCH}", env={"TEST_FAIL_EVALUATION_RANK": "1"}, restarts=0)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["epoch_0001.pt"]
    assert "the evaluation failed on rank 1: run_rank1.log in the run's folder says why" in \
        (run_dir / "run.log").read_text()
    assert "corrupt JPEG val/cat/7.jpg: cannot be decoded" in (run_dir / "run_rank1.log").read_text()


def _fail_evaluation():
    """This rank's evaluation fails, as a damaged image in its share of the set fails it."""
    from trainer.errors import DataError
    from trainer.loop import Trainer
    run_steps = Trainer.run_steps

    def fail_on_val(self, steps, source, on_step=None):
        if source is self.val_source:
            raise DataError("corrupt JPEG val/cat/7.jpg: cannot be decoded")
        return run_steps(self, steps, source, on_step)
    Trainer.run_steps = fail_on_val


def _die_at_training_step(k: int, killed: Path):
    """In a job's first attempt (`killed` does not exist yet), rank 1 kills itself as its k-th
    training step begins, and (TEST_RANK0_WAITS) rank 0 waits there until its agent stops it."""
    from trainer.executor import Executor
    run_step, done = Executor.run, Counter()
    rank = os.environ.get("RANK")

    def run_or_die(self, variant: str, buffer: str):
        done["train"] += variant.startswith("train")
        if done["train"] == k and rank == "1":
            killed.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if done["train"] == k and rank == "0" and os.environ.get("TEST_RANK0_WAITS"):
            time.sleep(120)
        run_step(self, variant, buffer)
    Executor.run = run_or_die


if __name__ == "__main__":  # a trainer process of the end-to-end tests, with their test hooks
    import runpy

    import trainer.setup
    if os.environ.get("TEST_FP32_CONVOLUTIONS"):  # cuDNN's default is TF32, which rounds to 10 bits
        torch.backends.cudnn.allow_tf32 = False
    if os.environ.get("TEST_GHOST_BN"):
        make_model = trainer.setup.make_model
        trainer.setup.make_model = lambda cfg: ghost_batch_norm(make_model(cfg), int(os.environ["TEST_GHOST_BN"]))
    # the restart count does not say a job's first attempt: an agent restarting its well workers for
    # another node's failed one does not count that restart
    killed_mark = Path.cwd() / f"rank1_killed_{os.environ.get('TORCHELASTIC_RUN_ID')}"
    if os.environ.get("TEST_KILL_AT_STEP") and not killed_mark.exists():
        _die_at_training_step(int(os.environ["TEST_KILL_AT_STEP"]), killed_mark)
    if "TEST_FAIL_EVALUATION_RANK" in os.environ and os.environ["TEST_FAIL_EVALUATION_RANK"] == os.environ.get("RANK"):
        _fail_evaluation()
    if os.environ.get("TEST_RANK1_ARGS") and os.environ.get("RANK") == "1":
        sys.argv += os.environ["TEST_RANK1_ARGS"].split()
    sys.argv[0] = str(ROOT / "run.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
