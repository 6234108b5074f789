"""A profiling target for Nsight Compute: the default layout's passes (a scale per 512
elements, 4 ranks) at 64M elements, each launched once after a warm call, between
``cudaProfilerStart`` and ``cudaProfilerStop``:

    ncu --profile-from-start off --kernel-name regex:"_compress_kernel|_decode_kernel" \\
        --section SpeedOfLight --section Occupancy python -m hvd_onebit_tools.bench.gpu_profile

``python -m hvd_onebit_tools.bench.gpu_profile cpu torch`` runs the same calls on CPU tensors
with the torch kernels (to try it without a GPU).
"""
import sys

import torch

from hvd_onebit.config import DEFAULT_BLOCK_SIZE
from hvd_onebit_tools.bench.kernel import _buffers, _calls, _fused_calls

PASSES = ("compress", "momentum_compress", "momentum_compress_preconditioned", "decode",
          "decode_update", "decode_update_preconditioned")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dev, backend = (argv[0], argv[1]) if len(argv) > 1 else ("cuda", "triton")
    L, b = _buffers(64 << 20, 4, dev, DEFAULT_BLOCK_SIZE)
    calls = {**_calls(L, b, backend), **_fused_calls(L, b, backend)}
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for name in PASSES:  # compiled and warm
        calls[name][0]()
    sync()
    if dev == "cuda":
        torch.cuda.cudart().cudaProfilerStart()
    for name in PASSES:
        print("profiling", name, flush=True)
        calls[name][0]()
        sync()
    if dev == "cuda":
        torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
