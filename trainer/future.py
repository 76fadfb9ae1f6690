"""TensorFuture: a device value on its way to the host. The copy is enqueued behind the
work that produces the value; nothing waits until the value is asked for."""
import asyncio
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

    def wait_for(self, timeout_ms: float) -> bool:
        """Poll until ready or timeout; True if ready."""
        deadline = time.perf_counter() + timeout_ms / 1000
        while not self.is_ready():
            if time.perf_counter() >= deadline:
                return False
            time.sleep(0.0002)
        return True

    def get(self) -> torch.Tensor:
        self.wait()
        return self._host

    def __await__(self):
        while not self.is_ready():
            yield from asyncio.sleep(0.0005).__await__()
        return self._host
