"""Would BatchNorm and ReLU folded into cuDNN's convolutions pay? Layer by layer on one
GPU, at the shapes of ResNet-50's bottlenecks or of the 32x32 ResNet-18's basic blocks
(fp16, channels-last), what our compiled step runs now against what cuDNN's graph API
can fuse:

  forward, now:   the convolution (ATen, cuDNN autotuned), inductor's statistics pass over
                  its output, inductor's normalize+ReLU of the convolution's input;
  forward, fused: one cuDNN graph: scale+bias+ReLU of the previous raw output as the
                  convolution's prologue, the statistics (sum, sum of squares) as its epilogue;
  backward, now:  dgrad and wgrad (ATen), inductor's BatchNorm+ReLU backward of the input;
  backward, fused: dgrad (ATen), cuDNN's BatchNorm+ReLU backward graph, and a wgrad that
                  re-applies scale+bias+ReLU to the raw input (the normalized input is never stored).

Each fused graph is checked against its torch computation first. Blocks' first layers
(stride, projection) are counted as the stage's other blocks; the block-end kernel
(normalize, residual add, ReLU) is the same in both and left out. Needs the
`nvidia-cudnn-frontend` package; the trainer does not use this.

    python bench/fusion_probe.py [batch] [resnet50 | resnet18_cifar]
"""
import sys

import cudnn
import torch
import torch.nn.functional as F

DEVICE = torch.device("cuda")
EPS = 1e-5
torch._dynamo.config.cache_size_limit = 64  # each shape is compiled on its own, as in the step
# (width, spatial size, blocks) of each stage, and each block's convolutions: (name, in, out
# channels as multiples of the width, kernel size, whether a BatchNorm+ReLU comes before it)
MODELS = {
    "resnet50": ([(64, 56, 3), (128, 28, 4), (256, 14, 6), (512, 7, 3)],
                 [("1x1 in", 4, 1, 1, False), ("3x3", 1, 1, 3, True), ("1x1 out", 1, 4, 1, True)]),
    "resnet18_cifar": ([(64, 32, 2), (128, 16, 2), (256, 8, 2), (512, 4, 2)],
                       [("3x3 a", 1, 1, 3, False), ("3x3 b", 1, 1, 3, True)]),
}


def timed(fn, reps: int = 10, rounds: int = 5) -> tuple[float, bool]:
    """Milliseconds per call: replays of a CUDA graph of `reps` calls (as the trainer runs
    them), or plain calls where capture fails (True when captured)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph, per = torch.cuda.CUDAGraph(), reps
    try:
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run = graph.replay
    except Exception:  # noqa: BLE001 - whatever the library raises, the plain calls are timed instead
        torch.cuda.synchronize()
        run, per = fn, 1
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(reps // per):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2], per > 1


class Graph:
    """A cuDNN graph, built and autotuned over its execution plans; called with a dict
    {graph tensor: torch tensor}."""

    def __init__(self, handle, build, plans: int = 3):
        self.handle = handle
        self.g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                               compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        self.io = build(self.g)
        self.g.validate()
        self.g.build_operation_graph()
        self.g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        self.g.check_support()
        self.g.build_plans(cudnn.build_plan_policy.ALL)
        self.plans = []
        for i in range(min(plans, self.g.get_execution_plan_count())):
            try:
                self.plans.append((i, self.g.get_workspace_size_plan_at_index(i)))
            except Exception:  # a plan that did not build
                continue
        self.workspace = torch.empty(max([w for _, w in self.plans] + [1]), dtype=torch.uint8, device=DEVICE)
        self.index = self.plans[0][0]

    def __call__(self, pack: dict):
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.g.execute_plan_at_index(pack, self.workspace, self.index, handle=self.handle)

    def tune(self, pack: dict) -> tuple[float, bool]:
        """The fastest plan's milliseconds, and whether it ran inside a CUDA graph."""
        best = None
        for i, _ in self.plans:
            self.index = i
            try:
                ms, captured = timed(lambda: self(pack))
            except Exception:  # noqa: BLE001 - a plan that fails to run is skipped
                continue
            if best is None or ms < best[0]:
                best = (ms, captured, i)
        self.index = best[2]
        return best[:2]


def tensor(g, t: torch.Tensor, name: str):
    return g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=t.dtype)


def channel(c: int, dtype=torch.float16, fill=None) -> torch.Tensor:
    t = torch.empty(1, c, 1, 1, device=DEVICE, dtype=dtype).to(memory_format=torch.channels_last)
    return t.copy_(fill) if fill is not None else t.uniform_(0.5, 1.5)


# -- inductor's kernels for the BatchNorm work around a convolution, as the compiled step runs them
@torch.compile(dynamic=False)
def stats(y):
    var, mean = torch.var_mean(y.float(), dim=(0, 2, 3), correction=0, keepdim=True)
    return mean, torch.rsqrt(var + EPS)


@torch.compile(dynamic=False)
def normalize_relu(y, scale, bias):
    return torch.relu(y * scale + bias).to(y.dtype)


@torch.compile(dynamic=False)
def bn_relu_backward(y, da, mean, invstd, gamma, beta):
    """d(input of BN) from d(ReLU output): the reduction pass and the elementwise pass."""
    xhat = (y.float() - mean) * invstd
    dz = torch.where(xhat * gamma + beta > 0, da.float(), 0.0)
    m = y.numel() // y.shape[1]
    sum_dz, sum_dzx = dz.sum((0, 2, 3), keepdim=True), (dz * xhat).sum((0, 2, 3), keepdim=True)
    return (gamma * invstd * (dz - sum_dz / m - xhat * sum_dzx / m)).to(y.dtype), sum_dzx, sum_dz


def unit(handle, n: int, cin: int, cout: int, hw: int, k: int, prologue: bool) -> dict:
    """Times, in ms, of one convolution with the BatchNorm work on both sides, now and fused."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def act(c):
        return torch.randn(n, c, hw, hw, generator=gen, device=DEVICE).half().to(memory_format=torch.channels_last)

    pad = k // 2
    y_prev, dy = act(cin), act(cout) * 0.01
    w = (torch.randn(cout, cin, k, k, generator=gen, device=DEVICE) / (cin * k * k) ** 0.5).half() \
        .to(memory_format=torch.channels_last)
    mean, invstd = stats(y_prev)
    gamma, beta = channel(cin, torch.float32), channel(cin, torch.float32, torch.full((1, cin, 1, 1), 0.1))
    scale, bias = (gamma * invstd).reshape(1, cin, 1, 1), (beta - mean * gamma * invstd).reshape(1, cin, 1, 1)
    scale16 = channel(cin, fill=scale.half())
    bias16 = channel(cin, fill=bias.half())
    a = normalize_relu(y_prev, scale16, bias16) if prologue else y_prev
    y = F.conv2d(a, w, padding=pad)
    r = {}

    def conv_bwd(mask):
        return torch.ops.aten.convolution_backward(dy, a, w, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], 1, mask)

    r["conv"], _ = timed(lambda: F.conv2d(a, w, padding=pad))
    r["stats"], _ = timed(lambda: stats(y))
    r["norm"] = timed(lambda: normalize_relu(y_prev, scale16, bias16))[0] if prologue else 0.0
    r["dgrad"], _ = timed(lambda: conv_bwd([True, False, False]))
    r["wgrad"], _ = timed(lambda: conv_bwd([False, True, False]))
    da = conv_bwd([True, False, False])[0]
    r["bnb"] = timed(lambda: bn_relu_backward(y_prev, da, mean, invstd, gamma, beta))[0] if prologue else 0.0

    # fused forward: [scale+bias+ReLU ->] conv -> statistics
    def fprop(g):
        x, wt = tensor(g, y_prev, "x"), tensor(g, w, "w")
        s, b = tensor(g, scale16, "s"), tensor(g, bias16, "b")
        inp = g.relu(input=g.bias(input=g.scale(input=x, scale=s), bias=b)) if prologue else x
        out = g.conv_fprop(image=inp, weight=wt, padding=[pad, pad], stride=[1, 1], dilation=[1, 1])
        out.set_output(True).set_data_type(cudnn.data_type.HALF)
        total, squares = g.genstats(input=out)
        total.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        squares.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        return (x, wt, s, b, out, total, squares) if prologue else (x, wt, out, total, squares)

    fused = Graph(handle, fprop)
    y_out, total, squares = torch.empty_like(y), channel(cout, torch.float32), channel(cout, torch.float32)
    pack = dict(zip(fused.io, (y_prev, w, scale16, bias16, y_out, total, squares) if prologue
                    else (y_prev, w, y_out, total, squares)))
    fused(pack)
    ref = F.conv2d(normalize_relu(y_prev, scale16, bias16) if prologue else y_prev, w, padding=pad).float()
    r["err_fprop"] = max(((y_out.float() - ref).abs().max() / ref.abs().max()).item(),
                         ((total.flatten() - ref.sum((0, 2, 3))).abs().max() / ref.sum((0, 2, 3)).abs().max()).item(),
                         ((squares.flatten() - ref.square().sum((0, 2, 3))).abs().max()
                          / ref.square().sum((0, 2, 3)).max()).item())
    r["fused_fprop"], r["captured"] = fused.tune(pack)
    if not prologue:
        return r

    # fused wgrad: the input's scale+bias+ReLU re-applied to the raw input
    def wgrad(g):
        x, d = tensor(g, y_prev, "x"), tensor(g, dy, "dy")
        s, b = tensor(g, scale16, "s"), tensor(g, bias16, "b")
        dw = g.conv_wgrad(image=g.relu(input=g.bias(input=g.scale(input=x, scale=s), bias=b)), loss=d,
                          padding=[pad, pad], stride=[1, 1], dilation=[1, 1])
        dw.set_output(True).set_dim([cout, cin, k, k]).set_data_type(cudnn.data_type.HALF)
        return x, d, s, b, dw

    fw = Graph(handle, wgrad)
    dw = torch.empty_like(w)
    pack = dict(zip(fw.io, (y_prev, dy, scale16, bias16, dw)))
    fw(pack)
    ref = conv_bwd([False, True, False])[1].float()
    r["err_wgrad"] = ((dw.float() - ref).abs().max() / ref.abs().max()).item()
    r["fused_wgrad"], captured = fw.tune(pack)
    r["captured"] &= captured

    # cuDNN's BatchNorm+ReLU backward: BN applied again, ReLU's mask, BN's backward
    def bnb(g):
        x, d = tensor(g, y_prev, "x"), tensor(g, da, "da")
        gm, bt = tensor(g, gamma, "gamma"), tensor(g, beta, "beta")
        mu, inv = tensor(g, mean.reshape(1, cin, 1, 1), "mean"), tensor(g, invstd.reshape(1, cin, 1, 1), "invstd")
        z = g.batchnorm_inference(input=x, mean=mu, inv_variance=inv, scale=gm, bias=bt)
        dz = g.relu_backward(loss=d, input=z)
        dz.set_data_type(cudnn.data_type.HALF)
        dx, dgamma, dbeta = g.batchnorm_backward(grad=dz, input=x, scale=gm, mean=mu, inv_variance=inv)
        dx.set_output(True)
        dgamma.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        dbeta.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        return x, d, gm, bt, mu, inv, dx, dgamma, dbeta

    fb = Graph(handle, bnb)
    dx, dgamma, dbeta = torch.empty_like(y_prev), channel(cin, torch.float32), channel(cin, torch.float32)
    pack = dict(zip(fb.io, (y_prev, da, gamma, beta, mean.reshape(1, cin, 1, 1).contiguous(),
                            invstd.reshape(1, cin, 1, 1).contiguous(), dx, dgamma, dbeta)))
    fb(pack)
    ref, ref_dgamma, ref_dbeta = (t.float() for t in bn_relu_backward(y_prev, da, mean, invstd, gamma, beta))
    r["err_bnb"] = max(((dx.float() - ref).abs().max() / ref.abs().max()).item(),
                       ((dgamma.flatten() - ref_dgamma.flatten()).abs().max() / ref_dgamma.abs().max()).item(),
                       ((dbeta.flatten() - ref_dbeta.flatten()).abs().max() / ref_dbeta.abs().max()).item())
    r["fused_bnb"], captured = fb.tune(pack)
    r["captured"] &= captured
    return r


def main(batch: int, model: str):
    stages, block = MODELS[model]
    torch.backends.cudnn.benchmark = True
    handle = cudnn.create_handle()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()} "
          f"(frontend {cudnn.__version__}, backend {cudnn.backend_version()}); {model} b{batch}, fp16, channels-last")
    head = ("layer", "blocks", "conv", "stats", "norm", "fused_fprop", "dgrad", "wgrad", "bnb", "fused_wgrad",
            "fused_bnb", "fwd now", "fwd fused", "bwd now", "bwd fused", "worst err", "cuDNN in a CUDA graph")
    print(" | ".join(head))
    totals = dict.fromkeys(("fwd now", "fwd fused", "bwd now", "bwd fused", "bwd cudnn bn only"), 0.0)
    for width, hw, blocks in stages:
        for name, c_in, c_out, k, prologue in block:
            cin, cout = c_in * width, c_out * width
            label = f"{hw}x{hw} {name} {cin}->{cout}"
            try:
                r = unit(handle, batch, cin, cout, hw, k, prologue)
            except Exception as e:  # noqa: BLE001 - an unsupported graph is a result here
                print(f"{label} | {blocks} | failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                continue
            r.setdefault("fused_wgrad", r["wgrad"])
            r.setdefault("fused_bnb", r["bnb"])
            row = {"fwd now": r["conv"] + r["stats"] + r["norm"], "fwd fused": r["fused_fprop"],
                   "bwd now": r["dgrad"] + r["wgrad"] + r["bnb"],
                   "bwd fused": r["dgrad"] + r["fused_wgrad"] + r["fused_bnb"],
                   "bwd cudnn bn only": r["dgrad"] + r["wgrad"] + r["fused_bnb"]}
            for key in totals:
                totals[key] += blocks * row[key]
            err = max(v for key, v in r.items() if key.startswith("err"))
            print(" | ".join([label, str(blocks)] + [f"{r[h]:.3f}" for h in head[2:11]]
                             + [f"{row[h]:.3f}" for h in head[11:15]] + [f"{err:.1e}", str(r["captured"])]), flush=True)
    print("whole network, ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in totals.items()))
    print(f"fused - now: forward {totals['fwd fused'] - totals['fwd now']:+.2f} ms, "
          f"backward {totals['bwd fused'] - totals['bwd now']:+.2f} ms "
          f"(cuDNN's BatchNorm backward alone: {totals['bwd cudnn bn only'] - totals['bwd now']:+.2f} ms)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256, sys.argv[2] if len(sys.argv) > 2 else "resnet50")
