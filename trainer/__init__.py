"""A configuration-driven image-classification trainer (docs/DESIGN.md)."""
import os

# DALI's pipelines and the step run on many CUDA streams. With CUDA's default of 8 hardware
# work queues, streams share queues, and DALI's small kernels wait behind the step's: the GPU
# JPEG decoder fell from 13,600 to 1,400 img/s beside matmuls, and training fed by it ran at
# 0.81 of its speed on data already on the device. With 32 queues: 12,400 img/s and 0.96
# (docs/BENCHMARKS.md). CUDA reads this when it starts, so it is set on import; a value the
# user set is kept.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
