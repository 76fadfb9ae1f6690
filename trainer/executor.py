"""Executor: one CUDA graph per (variant, input buffer) on a GPU, replayed every step;
on a CPU, or with graphs=false, the same Programs run eagerly."""
import torch
from torch import nn

from trainer.arena import Arena
from trainer.program import Program


def tune_convolutions(model: nn.Module, x: torch.Tensor):
    """cuDNN's autotuning (cudnn.benchmark) of each convolution of `model` on input `x`, one
    convolution at a time: its forward in an evaluation pass without autograd, then its
    backward alone on random tensors of the same shape and layout. A first step would tune
    them while its activations are alive: cuDNN's trial workspaces raised ResNet-18's
    first-step peak 32 MiB over the next steps' and over the eager loop's. The weights,
    their gradient slots and the BatchNorm statistics are left as they were."""
    seen = []

    def record(conv, args):
        seen.append((conv, args[0].shape, args[0].stride(), args[0].dtype, args[0].data_ptr() == x.data_ptr()))
    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, nn.Conv2d)]
    training = model.training
    try:
        with torch.no_grad():
            model.eval()(x)
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    with torch.enable_grad():
        for conv, shape, stride, dtype, reads_input in seen:
            inp = torch.empty_strided(shape, stride, dtype=dtype, device=x.device).normal_()
            wrt = [t for t in (inp.requires_grad_(not reads_input), conv.weight) if t.requires_grad]
            y = conv(inp)
            if wrt:  # the step's backward: no gradient for the model's input, none for frozen weights
                torch.autograd.grad(y, wrt, torch.randn_like(y))


class Executor:
    def __init__(self, programs: dict[tuple[str, str], Program], arena: Arena, use_graphs: bool,
                 warmup: int = 3):
        self.programs, self.arena, self.warmup = programs, arena, warmup
        self.use_graphs = use_graphs and arena.device.type == "cuda"
        self.graphs: dict[tuple[str, str], torch.cuda.CUDAGraph] = {}
        self.pool = None
        # Warm-up and capture share one stream: cuBLAS keeps a workspace (tens of MiB) for
        # every stream it has run on, so each extra stream would add to the peak.
        self.stream = torch.cuda.Stream(arena.device) if self.use_graphs else None

    def keys(self, train: bool) -> list[tuple[str, str]]:
        """The (variant, buffer) keys of the training programs, or of the evaluation ones."""
        return [k for k, p in self.programs.items() if p.variant.train == train]

    def capture(self, keys=None):
        """Warm up every program (or those of `keys`) (lazy initialization; cuDNN's autotuning
        first, convolution by convolution, where cudnn.benchmark asks for it) on the
        executor's stream, then capture each into a graph on it; all graphs share one
        memory pool for autograd's activations. cuBLAS's workspace is dropped before the
        capture and after it, as inductor's graph trees do: the capture then allocates it in
        the graphs' pool, where they share it, and nothing is left allocated beside the
        arena and the pool. Warm-up steps change weights, moments and BN statistics, so the
        arena is restored afterwards: training starts from exactly the bound state."""
        if not self.use_graphs:
            return
        programs = {k: self.programs[k] for k in (keys or self.programs)}
        snapshot = self.arena.storage.to("cpu")
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            first = next(iter(programs.values()))
            if torch.backends.cudnn.benchmark and first.variant.train:
                tune_convolutions(first.model, first.x)
            for program in programs.values():
                for _ in range(self.warmup):
                    program()
        torch.cuda.current_stream().wait_stream(self.stream)
        torch._C._cuda_clearCublasWorkspaces()
        self.pool = torch.cuda.graph_pool_handle()
        for key, program in programs.items():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                program()
            self.graphs[key] = graph
        torch._C._cuda_clearCublasWorkspaces()
        self.arena.storage.copy_(snapshot)

    def run(self, variant: str, buffer: str):
        if self.use_graphs:
            self.graphs[(variant, buffer)].replay()
        else:
            self.programs[(variant, buffer)]()
