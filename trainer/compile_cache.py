"""compile=true with compile_cache=DIR: torch.compile's caches carried in a folder.

Inductor keeps what it compiled (the generated code with its Triton binaries and each
kernel's tuning) and AOTAutograd its traced forward and backward in caches on the machine
(TORCHINDUCTOR_CACHE_DIR). A machine that never compiled the model compiles it cold, every
kernel tuned: ResNet-50's first step takes 55 s on an H200 against 11 s with the caches
warm (docs/BENCHMARKS.md). The folder carries those caches between machines, through
torch's portable cache bundles (torch.compiler.save_cache_artifacts/load_cache_artifacts):
before the first compile, set-up loads every bundle of this torch and kind of device into
the machine's caches; after set-up and at the end of the run (or of mode=eval), the main
process saves one more bundle if it compiled anything the caches lacked since it last
loaded or saved.
Inductor's own keys (the graph, the inductor settings, torch, Triton, the device) decide
what a bundle serves, so one that fits nothing costs its load."""
import hashlib
import logging
import re
import uuid
from pathlib import Path

import torch

log = logging.getLogger("trainer")


def _misses() -> int:
    """Compilations so far in this process that the caches could not serve."""
    from torch._dynamo.utils import counters  # Dynamo's import takes seconds: only with compile=true
    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]


class CompileCache:
    """The folder's bundles for this torch and kind of device: loaded once, saved as new ones."""

    def __init__(self, folder: Path, device: torch.device):
        kind = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self.folder = folder
        self.prefix = re.sub(r"[^\w.+-]+", "_", f"torch{torch.__version__}-{kind}")
        self.misses_seen = 0

    def load(self):
        """Into the machine's caches, before the first compile."""
        artifacts = 0
        for path in sorted(self.folder.glob(f"{self.prefix}-*.bin")):
            try:
                info = torch.compiler.load_cache_artifacts(path.read_bytes())
            except Exception as e:  # noqa: BLE001 - a bad bundle costs a compile, not the run
                info = None
                log.debug("compile_cache: %s: %s", path, e)
            if info is None:
                log.warning("compile_cache: skipping %s, which does not load as torch %s's cache bundle", path,
                            torch.__version__)
                continue
            artifacts += sum(len(keys) for keys in info.artifacts.values())
        log.info("compile_cache: %d cached compilations loaded from %s", artifacts, self.folder)
        self.misses_seen = _misses()

    def save(self):
        """This process's compilations as one bundle, where the caches lacked any since the last load or save."""
        misses = _misses()
        if misses == self.misses_seen:
            return
        self.misses_seen = misses
        path = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            data, _ = torch.compiler.save_cache_artifacts()
            path = self.folder / f"{self.prefix}-{hashlib.sha256(data).hexdigest()[:16]}.bin"
            partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")  # whole or absent: renamed when written
            partial.write_bytes(data)
            partial.replace(path)
            log.info("compile_cache: saved %s (%.1f MiB)", path, len(data) / 2**20)
        except Exception as e:  # noqa: BLE001 - the run has what it compiled; only the next machine loses
            log.warning("compile_cache: could not save %s (%s: %s)", path or self.folder, type(e).__name__, e)
