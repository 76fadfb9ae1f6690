"""Compile the BatchNorm kernels for an H200 (sm_90) ahead of time, each pass at the tiles
it runs with and at a few channel counts, as the JIT compiles them (16-byte aligned
pointers and sizes). Needs no GPU, only the ptxas that Triton carries. Prints, per pass
and channel count, the shared memory a program takes and whether its loads are staged
through it (cp.async), as JSON.

    python tests/compile_for_h200.py

Run in a process of its own, without TRITON_INTERPRET: Triton's interpreter, once on,
takes over compilation for the whole process (tests/test_kernels_h200.py does that).
"""
import json
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import triton_ops  # noqa: E402

CHANNELS = (64, 256, 2048)
KINDS = {torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32", torch.uint8: "*u8"}


def compile_for_h200(kernel, args: dict, warps: int):
    """`kernel` compiled for sm_90 with these arguments: tensors by their dtype, floats as
    fp32 and ints as i32 scalars, constexprs by value."""
    params = {p.name: p for p in kernel.params}
    signature = {name: "constexpr" if params[name].is_constexpr else KINDS[value.dtype] if torch.is_tensor(value)
                 else "fp32" if isinstance(value, float) else "i32" for name, value in args.items()}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if signature[name] not in ("fp32", "constexpr")}
    constexprs = {name: value for name, value in args.items() if params[name].is_constexpr}
    return triton.compile(ASTSource(kernel, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps})


def passes(channels: int):
    """(name, kernel, arguments, tiles) of each pass at ResNet-50's 56x56 maps, batch 256."""
    half, single, counters = torch.empty(1, dtype=torch.float16), torch.empty(1), torch.empty(1, dtype=torch.int32)
    packed = torch.empty(1, dtype=torch.uint8)  # a ReLU mask, 8 channels a byte
    common = dict(x_ptr=half, g_ptr=half)
    statistics = dict(mean_ptr=single, invstd_ptr=single, w_ptr=single, b_ptr=single)
    for name, tiles in (("statistics", triton_ops.BN_STATS), ("sums", triton_ops.BN_SUMS),
                        ("sums with the ReLU", triton_ops.BN_SUMS), ("sums of a block's end", triton_ops.BN_SUMS)):
        block_r, block_c = tiles.block(channels)
        end = name.endswith("end")  # a shortcut's gradient added, the output's mask, the sum kept
        yield name, triton_ops._bn_reduce_kernel, dict(
            **common, more_ptr=half, mask_ptr=packed, dz_ptr=half, **statistics, part_ptr=single,
            count_ptr=counters, out1_ptr=single, out2_ptr=single, M=802816, C=channels, HW=1, programs=264,
            momentum=0.1, eps=1e-5, BACKWARD=name != "statistics", RELU=name.endswith("ReLU"), MORE=end,
            MASK="packed" if end else "", PER_IMAGE=False, BLOCK_R=block_r, BLOCK_C=block_c,
            STAGES=tiles.stages), tiles
    tiles = triton_ops.BN_GRADIENT
    block_r, block_c = tiles.block(channels)
    yield "gradient", triton_ops._bn_backward_apply_kernel, dict(
        **common, dx_ptr=half, **statistics, dbias_ptr=single, dweight_ptr=single, M=802816, C=channels, RELU=True,
        BLOCK_R=block_r, BLOCK_C=block_c, STAGES=tiles.stages), tiles
    tiles = triton_ops.BN_NORMALIZE
    block_r, block_c = tiles.block(channels)
    yield "normalization", triton_ops._bn_normalize_kernel, dict(
        x_ptr=half, r_ptr=half, y_ptr=half, mask_ptr=packed, **statistics, M=802816, C=channels, RESIDUAL=True,
        RELU=True, MASK=True, BLOCK_R=block_r, BLOCK_C=block_c, STAGES=tiles.stages), tiles


def main():
    out = {}
    for channels in CHANNELS:
        for name, kernel, args, tiles in passes(channels):
            compiled = compile_for_h200(kernel, args, tiles.warps)
            out[f"{name} C={channels}"] = {"shared": compiled.metadata.shared, "stages": tiles.stages,
                                           "staged": "cp.async" in compiled.asm["ptx"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
