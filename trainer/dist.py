"""The process group: who this process is among the ranks of a torchrun job, and the
collective ops the loop calls. With one process every collective is the identity (BN
statistics are copied to B_PREV).

One run directory serves the whole job: launch_overrides() gives every rank the same one,
the same again when torchrun restarts the job, and trainer.run_dir.restart_checkpoint()
then continues from its newest checkpoint. Rank 0 writes run.log, metrics, plots and
checkpoints; every other rank writes its warnings and errors to run_rank<r>.log there.
"""
import atexit
import hashlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as td

from trainer.arena import Arena
from trainer.collectives import Comm, GradSync, ShardedUpdate
from trainer.errors import ConfigError, PeerError, PlanError
from trainer.regions import Region as R
from trainer.run_dir import agent_started_at, given, launched, override, ranks, resumed_folder


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    comm: Comm | None = None  # None: a single process
    grad_sync: GradSync | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def grad_sync_factory(self, ops):
        """The gradient range ops the step calls right after backward (None alone). Under
        sharding the ops' update becomes this rank's share of it."""
        if self.comm is None:
            return None
        sharded = ops.config.shards > 1
        if sharded:
            ops.shard = ShardedUpdate(ops, self.comm)
        self.grad_sync = GradSync(ops, self.comm, sharded)
        return self.grad_sync

    def prepare(self, engine):
        """Before the first step: every rank must have built the same plan and gradient
        buckets (else the collectives would pair different tensors, or hang); all start from
        rank 0's weights and BN statistics (a data-dependent init saw only its rank's data);
        G_DEEP_CONV's buckets start reducing during backward."""
        if self.comm is None:
            return
        self.agree("plan fingerprint", engine.plans.fingerprint())
        self.agree("gradient buckets", hashlib.sha256(self.grad_sync.layout().encode()).hexdigest()[:16])
        offset, nbytes = engine.arena.plan.range(R.B_PREV_MEAN, R.A_DEEP_CONV)
        self.comm.broadcast_(engine.arena.storage[offset:offset + nbytes])
        self.grad_sync.watch(engine.model, engine.plans.tensors[engine.plans.variants[0].name])

    def agree(self, what: str, value: str):
        """Stop every rank, naming the ranks whose `value` differs from rank 0's."""
        mine = torch.tensor(list(value.encode().ljust(64)[:64]), dtype=torch.uint8, device=self._device())
        every = torch.empty(self.world * 64, dtype=torch.uint8, device=mine.device)
        self.comm.gather_(every, mine)
        values = [bytes(row).decode().rstrip() for row in every.view(self.world, 64).tolist()]
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            raise PlanError(f"the ranks built different plans: the {what} of rank 0 is {values[0]}, but "
                            + ", ".join(f"rank {r} has {values[r]}" for r in differ)
                            + ". Launch every rank with the same configuration and code (model, optimizer, "
                              "amp, batch size, data sizes, dist.* settings).", alike=True)

    def average_bn(self, ops):
        """BN_STATS_ALLREDUCE: B_PREV = the mean over ranks of B_NEXT (of B_PREV, the
        statistics' average, under EMA)."""
        ops.bn_stats_to_prev()
        if self.comm is not None:
            self.comm.mean_(ops.b_prev)

    def all_sum_(self, x: torch.Tensor):
        """Sum a small tensor (metric sums) over ranks, in place."""
        if self.comm is not None:
            self.comm.sum_(x)

    def raise_failures(self, error: Exception | None, what: str):
        """After a part of the run in which one rank may fail alone (a damaged image in its
        share of the evaluation set): every rank learns which failed, and every rank raises,
        a failed one its own error, so that all take the same way out (a checkpoint's save,
        which is collective) where the others would wait for it in the next collective. Each
        rank's flag is a digest of its error: one that rank 0 met too (a batch size too large
        for every rank's share, a data set missing everywhere) is marked alike, and rank 0
        alone says it, as it says the others' PeerError; another rank's own error is said by
        that rank too."""
        digests = [_digest(error)]  # of a single process, rank 0
        if self.comm is not None:
            every = torch.zeros(self.world, dtype=torch.int64, device=self._device())
            every[self.rank] = digests[0]
            self.comm.sum_(every)
            digests = every.tolist()
        failed = [r for r, digest in enumerate(digests) if digest]
        if error is not None:
            error.alike = digests[self.rank] == digests[0]
            raise error
        if failed:
            logs = ", ".join("run.log" if r == 0 else f"run_rank{r}.log" for r in failed)
            raise PeerError(f"the {what} failed on rank {', '.join(map(str, failed))}: {logs} in the run's folder "
                            "says why", alike=True)

    def gather_per_rank(self, arena: Arena) -> dict:
        """Every rank's bytes, rank after rank, of the regions that differ between ranks: the
        BN statistics of its own batches (B_NEXT, and their average B_PREV under EMA) and,
        sharded, its share of the moments. For a checkpoint that rank 0 writes whole; every
        rank must call it."""
        if self.comm is None:
            return {}
        plan, out = arena.plan, {}
        own_stats = (R.B_NEXT_MEAN, R.B_NEXT_VAR) + ((R.B_PREV_MEAN, R.B_PREV_VAR) if plan.config.ema else ())
        for r in R:
            if (r in own_stats or plan.config.sharded(r)) and plan.region_bytes(r):
                offset, nbytes = plan.range(r)
                every = torch.empty(self.world * nbytes, dtype=torch.uint8, device=arena.device)
                self.comm.gather_(every, arena.storage[offset:offset + nbytes])
                out[r.name] = every.cpu()
        return out

    def _device(self) -> torch.device:
        return torch.device("cpu") if self.comm.stream is None else torch.device("cuda", self.local_rank)


def _digest(error: Exception | None) -> int:
    """0 for none, else a positive int64 that differs between errors of another type or message."""
    if error is None:
        return 0
    said = f"{type(error).__name__}: {error}".encode(errors="surrogateescape")  # a file name that is not UTF-8
    return int.from_bytes(hashlib.sha256(said).digest()[:7], "big") | 1


def from_env() -> Dist:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or a single process."""
    return Dist(*ranks())


def start(cfg) -> Dist:
    """Join the job's process group: NCCL on GPUs, gloo on CPUs (cfg.dist.backend=auto),
    one GPU per local rank. Outside torchrun: a single process, no group."""
    d = from_env()
    if not launched():
        return d
    device = device_for(cfg.device, d)
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else "nccl" if device.type == "cuda" else "gloo"
    if (backend == "nccl") != (device.type == "cuda"):
        raise ConfigError(f"dist.backend={backend} does not run on {device.type}: NCCL needs GPUs (and "
                          f"collectives inside captured CUDA graphs need NCCL), gloo runs on CPUs; "
                          f"use dist.backend=auto")
    if device.type == "cuda":
        if d.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {d.local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                              f"launch at most that many processes per node (--nproc_per_node)")
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=cfg.dist.timeout_s)
    td.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None,
                          **_attempt_store(d, timeout))
    atexit.register(td.destroy_process_group)
    return Dist(d.rank, d.world, d.local_rank, Comm(d.rank, d.world, device, backend))


def _attempt_store(d: Dist, timeout: timedelta) -> dict:
    """The store this attempt's ranks meet in. torchrun's agent serves one store for the whole
    job (TORCHELASTIC_USE_AGENT_STORE) and keeps what an earlier attempt's ranks wrote there:
    a restarted job's workers read the addresses the dead ones left (gloo's mesh, NCCL's unique
    id) and failed or hung. A prefix per TORCHELASTIC_RESTART_COUNT did not keep the attempts
    apart across nodes: an agent that restarts its workers because another node's failed does
    not count that restart. So rank 0 serves a store of its own, new with each attempt, on a
    free port of its node (MASTER_ADDR), and leaves the port in the agent's store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    host = os.environ["MASTER_ADDR"]
    agent = td.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    if d.rank == 0:
        store = td.TCPStore(host, 0, d.world, is_master=True, timeout=timeout, wait_for_workers=False)
        agent.set(_STORE_PORT, str(store.port))
    else:
        store = _rank_0s_store(agent, host, timeout)
    return {"store": store, "rank": d.rank, "world_size": d.world}


_STORE_PORT = "/trainer/store_port"


def _rank_0s_store(agent, host: str, timeout: timedelta):
    """The store that this attempt's rank 0 serves. The port read may be an ended attempt's,
    where nothing answers any more (torchrun's agents stop every worker before the next
    attempt starts): read again until this attempt's rank 0 has written its own."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            store = td.TCPStore(host, int(agent.get(_STORE_PORT)), is_master=False, timeout=timedelta(seconds=2))
        except (RuntimeError, TimeoutError):  # DistStoreError and DistNetworkError are RuntimeErrors
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        store.set_timeout(timeout)
        return store


def device_for(choice: str, d: Dist) -> torch.device:
    gpu = torch.cuda.is_available()
    if choice == "cpu" or (choice == "auto" and not gpu):
        return torch.device("cpu")
    if not gpu:
        raise ConfigError("device=cuda, but torch finds no usable GPU here (no driver, no device, or a CPU-only "
                          "torch build); use device=auto, which trains on the CPU then, or device=cpu")
    return torch.device("cuda", d.local_rank)


def launch_overrides(argv: list[str], env=os.environ) -> list[str]:
    """Hydra overrides for one rank of a torchrun job (none outside one). Hydra's timestamped
    directory would differ between ranks and between torchrun's restarts, so every rank
    gets outputs/torchrun/<job id> unless the command line names hydra.run.dir; a job that
    resumes a run goes on in that run's folder, as a single process does (trainer/app.py)."""
    if not launched(env):
        return []
    if {"-m", "--multirun"} & set(argv):  # each rank swept on its own, and the second job set up NCCL again
        raise ConfigError("a sweep (-m) does not run under torchrun, whose job is one run: start a torchrun job for "
                          "each of the sweep's runs, or sweep with one process", alike=True)
    out, args = [], given(argv)
    if args.get("mode") == "export" and ranks(env)[1] > 1:  # each rank read the checkpoint, and rank 0 wrote it out
        raise ConfigError("mode=export copies a checkpoint's weights out in one process, whatever number of ranks "
                          "wrote it: run it without torchrun (python run.py mode=export ...)", alike=True)
    if "hydra.run.dir" not in args:
        resume = os.path.expanduser(args.get("trainer.resume", "").strip("'\""))  # as Hydra and the config read it
        folder = resumed_folder(resume) if resume else None
        out.append(override("hydra.run.dir", folder or f"outputs/torchrun/{job_id(env)}", shell=False))
    rank = ranks(env)[0]
    if rank:  # rank 0 keeps run.log and .hydra/; the others log their warnings and errors
        out += [f"hydra.job.name=run_rank{rank}", "hydra.output_subdir=null", "hydra.job_logging.root.level=WARNING"]
    return out


def job_id(env=os.environ) -> str:
    """torchrun's run id (--rdzv_id; a fresh uuid for a single-node launch). A static
    rendezvous (--master_port) has none: on one node the workers' parent, torchrun's agent,
    identifies the job (it outlives restarts); across nodes the nodes cannot agree on one."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if run_id not in ("", "none"):
        return run_id
    if env["WORLD_SIZE"] != env.get("LOCAL_WORLD_SIZE"):
        raise ConfigError("a multi-node torchrun job needs --rdzv_id=JOB_ID (or hydra.run.dir=DIR on a shared "
                          "filesystem), so that every node writes to and resumes from one run directory", alike=True)
    return _agent_started()


def _agent_started() -> str:
    """The start time and pid of the parent process (Linux /proc), else its pid."""
    agent, started = os.getppid(), agent_started_at()
    if started is None:
        return f"agent{agent}"
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(started)) + f"_{agent}"
