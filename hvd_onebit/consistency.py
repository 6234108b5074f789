"""Cross-rank checks: the same parameters everywhere at construction, bit-identical parameters
during training. Each is one small allgather and raises the same error on every rank. The
figures are computed here without a framework; the Horovod checks gather them through Horovod
(imported when called), the DDP face through torch.distributed."""
from __future__ import annotations

import hashlib
from typing import Mapping

import torch


def parameter_signature(param_groups: list[dict], names: Mapping[torch.Tensor, str]) -> list[int]:
    """[parameter count, element count, a digest of the names, shapes and dtypes]."""
    shapes = repr([(names.get(p), tuple(p.shape), str(p.dtype))
                   for g in param_groups for p in g["params"]])
    digest = int.from_bytes(hashlib.sha256(shapes.encode()).digest()[:7], "little")
    return [sum(len(g["params"]) for g in param_groups),
            sum(p.numel() for g in param_groups for p in g["params"]), digest]


def check_same_parameters(param_groups: list[dict], names: Mapping[torch.Tensor, str],
                          process_set) -> None:
    """Raise on every rank if the ranks' parameters differ in number, shape, dtype or name."""
    import horovod.torch as hvd

    mine = torch.tensor([parameter_signature(param_groups, names)], dtype=torch.int64)
    everyone = hvd.allgather(mine, name="hvd_onebit.param_signature",
                             process_set=process_set).tolist()
    if any(row != everyone[0] for row in everyone):
        detail = "; ".join(f"rank {r}: {row[0]} parameters, {row[1]} elements"
                           for r, row in enumerate(everyone))
        raise ValueError("hvd_onebit.DistributedOptimizer: the ranks' parameters differ in "
                         f"number, shape, dtype or name ({detail})")


def parameter_bit_sums(param_groups: list[dict]) -> torch.Tensor:
    """[1, k] int64: the sum of each parameter's bits (as integers), in param-group order."""
    sums = []
    for g in param_groups:
        for p in g["params"]:
            flat = p.detach().reshape(-1)
            bits = flat.view(torch.int16 if flat.element_size() == 2 else torch.int32)
            sums.append(bits.to(torch.int64).sum())
    return torch.stack(sums).reshape(1, -1) if sums else torch.zeros(1, 1, dtype=torch.int64)


def raise_if_diverged(everyone: torch.Tensor, step: int, check_every: int) -> None:
    """``everyone``: every rank's :func:`parameter_bit_sums`, one row per rank in rank order."""
    differ = [r for r in range(everyone.shape[0]) if not torch.equal(everyone[r], everyone[0])]
    if differ:
        raise RuntimeError(
            f"hvd_onebit: parameters diverged across ranks at step {step}: "
            f"rank(s) {differ} differ from rank 0 (check_every={check_every})")


def check_parameters_identical(param_groups: list[dict], process_set, step: int,
                               check_every: int) -> None:
    """Raise on every rank if the parameters are no longer bit-identical across ranks (a sum of
    each parameter's bits, compared after one Horovod allgather)."""
    import horovod.torch as hvd

    everyone = hvd.allgather(parameter_bit_sums(param_groups), name="hvd_onebit.consistency",
                             process_set=process_set)
    raise_if_diverged(everyone, step, check_every)
