"""TensorFuture: a device value on its way to the host. The copy is enqueued behind the
work that produces the value; nothing waits until the value is asked for."""
import time

import torch


class TensorFuture:
    def __init__(self, src: torch.Tensor):
        if src.device.type == "cuda":
            self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self._host.copy_(src, non_blocking=True)
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self._host, self.event = src.clone(), None
        self.enqueued_at = time.perf_counter()

    def is_ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self):
        if self.event is not None:
            self.event.synchronize()

    def get(self) -> torch.Tensor:
        self.wait()
        return self._host
