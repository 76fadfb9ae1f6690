"""TensorFuture: values reach the host only when asked for, and waiting never blocks an event loop."""
import asyncio

import torch

from tests.helpers import bound, small_cnn
from trainer.future import TensorFuture
from trainer.plan import Baseline as B
from trainer.regions import Region as R


def test_future_holds_the_value_at_enqueue_time():
    x = torch.arange(4.0)
    f = TensorFuture(x)
    x.add_(10)  # later work does not change what the future reports
    assert f.is_ready() and f.wait_for(1.0)
    assert torch.equal(f.get(), torch.arange(4.0))


def test_future_can_be_awaited_alongside_other_tasks():
    async def main():
        ticks = []

        async def ticker():
            for i in range(3):
                ticks.append(i)
                await asyncio.sleep(0)

        value, _ = await asyncio.gather(TensorFuture(torch.ones(2)), ticker())
        return value, ticks

    value, ticks = asyncio.run(main())
    assert torch.equal(value, torch.ones(2)) and ticks == [0, 1, 2]


def test_arena_to_host_async_of_a_dtensor_and_of_a_region():
    plans, arena, ops = bound(small_cnn())
    ops.s[B.STEP].fill_(7)
    assert arena.to_host_async(plans.main[B.STEP]).get().tolist() == [7]
    region = arena.to_host_async(R.W_DEEP_CONV).get()
    assert torch.equal(region, arena.flat(R.W_DEEP_CONV))
    span = arena.to_host_async((R.G_BN_BIAS, R.G_DEEP_CONV)).get()
    assert span.numel() == arena.flat(R.G_BN_BIAS, R.G_DEEP_CONV).numel()
