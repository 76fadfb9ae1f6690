"""The double buffer: the loader fills input buffer A while the step reads B, and the other
way round. CUDA events order the two streams, so a buffer is never overwritten while a
step still reads it and never read before it is complete, and the host never waits."""
import torch

from trainer.arena import Arena
from trainer.planner import ModelTensors
from trainer.variants import Variant

BUFFERS = ("A", "B")


class DoubleBuffer:
    def __init__(self, arena: Arena, tensors: dict[str, ModelTensors]):
        self.arena, self.tensors = arena, tensors
        cuda = arena.device.type == "cuda"
        self.stream = torch.cuda.Stream(arena.device) if cuda else None
        self._ready = {b: torch.cuda.Event() for b in BUFFERS} if cuda else {}
        self._free = {b: torch.cuda.Event() for b in BUFFERS} if cuda else {}

    def fill(self, buffer: str, variant: Variant, source):
        """Enqueue the source's next batch into `buffer`, after the last step that read it."""
        t = self.tensors[variant.name].input
        data = self.arena.view(t.data[buffer], padded=True)
        label, mask = self.arena[t.label[buffer]], self.arena[t.mask[buffer]]
        if self.stream is None:
            return source.fill(data, label, mask, None)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self._free[buffer])
            source.fill(data, label, mask, self.stream)
            self._ready[buffer].record(self.stream)

    def acquire(self, buffer: str):
        """The compute stream waits until the buffer's batch is complete."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_event(self._ready[buffer])

    def release(self, buffer: str):
        """Mark the buffer free once the work enqueued so far (the step reading it) is done."""
        if self.stream is not None:
            self._free[buffer].record(torch.cuda.current_stream())
