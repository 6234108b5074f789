"""The float dtypes, named once: what is trained and reduced, and which of those are low precision.

* :data:`FLOAT_DTYPES`: float32, float16 and bfloat16. The parameters the optimizer trains, the
  inputs :class:`~hvd_onebit.OneBitAllreduce` takes, and the gradients and weights the fused
  Triton passes read and write in place.
* :data:`LOW_PRECISION_DTYPES`: float16 and bfloat16, the parameters whose Adam state is float32
  (:mod:`hvd_onebit.low_precision`). The 1-bit kernels compute in float32 whatever the dtype.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)


def other_dtypes(tensors) -> list[str]:
    """The dtypes of ``tensors`` outside :data:`FLOAT_DTYPES`, named, sorted, each once."""
    return sorted({str(t.dtype) for t in tensors if t.dtype not in FLOAT_DTYPES})


def check_converted(tensors) -> None:
    """Raise TypeError where a parameter or gradient the optimizer was built for float dtypes
    has another dtype now (the model converted since, ``model.double()``)."""
    bad = other_dtypes(tensors)
    if bad:
        raise TypeError(f"hvd_onebit trains float32, float16 and bfloat16 parameters; got "
                        f"{', '.join(bad)} at this step (the model converted after the optimizer "
                        "was built, such as model.double()?): convert the model first, then "
                        "wrap it in DDP and build the optimizer")
