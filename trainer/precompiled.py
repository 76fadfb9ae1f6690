"""compile=true with compile_cache=DIR: the model's forward and backward compiled ahead of
time (torch.compile's aot_compile) and kept in DIR, one file per input shape and mode. A
run loads the files that serve its calls instead of Dynamo's trace and inductor's compile
(on a CPU 1 s against 7 s for ResNet-50 with inductor's caches warm, docs/BENCHMARKS.md),
and compiles and adds the ones it lacks. Each loaded function checks its guards before
it runs (shapes, dtypes, train or eval mode, grad mode, which weights train); what the
guards cannot see, the code, names the files: a change to the trainer's or the kernels'
source, torch, the device or the inductor settings starts a new set."""
import hashlib
import logging
import uuid
from pathlib import Path

import torch
from torch import nn

import kernels
import trainer

log = logging.getLogger("trainer")

# the code a compiled forward runs: the model, its BatchNorm and pooling Functions, the kernels
_SOURCES = (Path(trainer.__file__).parent, Path(kernels.__file__).parent)


def source_digest() -> str:
    h = hashlib.sha256()
    for folder in _SOURCES:
        for path in sorted(folder.rglob("*.py")):
            h.update(path.relative_to(folder.parent).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def aot_switch():
    """Dynamo's setting that gives torch.compile's result its aot_compile, on; torch 2.11
    has it off by default, 2.14 on."""
    switch = {"enable_aot_compile": True} if hasattr(torch._dynamo.config, "enable_aot_compile") else {}
    return torch._dynamo.config.patch(**switch)


def aot_compile_available() -> bool:
    with aot_switch():
        return hasattr(torch.compile(len), "aot_compile")


def compile_ahead(model: nn.Module, x: torch.Tensor, options: dict):
    """model's forward on inputs like x, with its backward, compiled ahead of time: called
    as fn(model, x), saved by fn.save_compiled_function(path)."""
    with aot_switch():
        return torch.compile(model.forward, fullgraph=True, dynamic=False, options=options).aot_compile(((x,), {}))


class Precompiled:
    """Callable as the model is, on one input: runs the first artifact whose guards take
    the call, loading the folder's files as it needs them and compiling a new one when
    none does."""

    def __init__(self, model: nn.Module, options: dict, folder: Path):
        self.model, self.options, self.folder = model, options, folder
        self.loaded, self.unread, self.prefix = [], None, None

    def _name_prefix(self, x: torch.Tensor) -> str:
        device = torch.cuda.get_device_name(x.device) if x.device.type == "cuda" else x.device.type
        key = repr((torch.__version__, device, sorted(self.options.items()), source_digest()))
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.prefix is None:
            self.prefix = self._name_prefix(x)
            self.folder.mkdir(parents=True, exist_ok=True)
            self.unread = sorted(self.folder.glob(f"{self.prefix}-*.aot"))
        for fn in self.loaded:
            if fn.guard_check(self.model, x):
                return fn(self.model, x)
        while self.unread:
            fn = self._load(self.unread.pop(0))
            if fn is not None:
                self.loaded.append(fn)
                if fn.guard_check(self.model, x):
                    return fn(self.model, x)
        fn = self._compile(x)
        self.loaded.append(fn)
        return fn(self.model, x)

    def _load(self, path: Path):
        try:
            with open(path, "rb") as f:
                return torch.compiler.load_compiled_function(f)
        except Exception as e:  # a truncated or foreign file costs a compile, not the run
            log.warning("compile_cache: skipping %s, which does not load (%s)", path, _first_line(e))
            return None

    def _compile(self, x: torch.Tensor):
        fn = compile_ahead(self.model, x, self.options)
        path = self.folder / f"{self.prefix}-{uuid.uuid4().hex[:12]}.aot"  # ranks may add theirs at once
        try:
            fn.save_compiled_function(str(path))  # written to a temporary file and renamed
            log.info("compile_cache: compiled and saved %s", path)
        except Exception as e:  # the compiled function still serves this run
            log.warning("compile_cache: compiled, but could not save %s (%s)", path, _first_line(e))
        return fn


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
