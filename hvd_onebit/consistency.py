"""Cross-rank checks: the same parameters (in the same order) and options everywhere at
construction, bit-identical parameters during training. Each is one small allgather and
raises the same error on every rank, naming what differs. The figures are computed here
without a framework; the Horovod checks gather them through Horovod (imported when called),
the DDP face through torch.distributed."""
from __future__ import annotations

import builtins
import dataclasses
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


@dataclass(frozen=True)
class JobSignature:
    """What every rank's optimizer must agree on, as integers one allgather carries
    (:meth:`row`): its parameters in the optimizer's order (their names, shapes and dtypes
    digested), which of them are trainable (``requires_grad``, digested), its ``freeze_step``
    (-1: "auto") and each other option (digested, one each, in the config's field order;
    ``option_names`` are theirs, the same on every rank, not sent)."""

    parameters: int
    elements: int
    layout: int
    trainable: int
    freeze_step: int
    options: tuple
    option_names: tuple = ()

    @classmethod
    def of(cls, param_groups: list[dict], names: Mapping[torch.Tensor, str],
           config) -> "JobSignature":
        params = [p for g in param_groups for p in g["params"]]
        layout = repr([(names.get(p), tuple(p.shape), str(p.dtype)) for p in params])
        trainable = repr([p.requires_grad for p in params])
        freeze = config.freeze_step if isinstance(config.freeze_step, int) else -1
        option_names = tuple(f.name for f in dataclasses.fields(config) if f.name != "freeze_step")
        options = tuple(_digest(repr(getattr(config, name))) for name in option_names)
        return cls(len(params), sum(p.numel() for p in params), _digest(layout),
                   _digest(trainable), freeze, options, option_names)

    def row(self) -> list[int]:
        """The integers the allgather carries."""
        return [self.parameters, self.elements, self.layout, self.trainable, self.freeze_step,
                *self.options]

    def from_row(self, row: list[int]) -> "JobSignature":
        """Another rank's signature from its :meth:`row`, with this one's option names."""
        return JobSignature(*row[:5], tuple(row[5:]), self.option_names)

    def differences(self, everyone: list["JobSignature"]) -> list[str]:
        """What ``everyone`` (each rank's signature, in rank order) disagrees on, in words."""
        def ranks_unlike_0(field: str) -> list[int]:
            return [r for r, s in enumerate(everyone)
                    if getattr(s, field) != getattr(everyone[0], field)]

        out = []
        if ranks_unlike_0("parameters") or ranks_unlike_0("elements"):
            out.append("their parameters (" + ", ".join(
                f"rank {r}: {s.parameters} ({s.elements} elements)"
                for r, s in enumerate(everyone)) + ")")
        elif ranks_unlike_0("layout"):
            out.append(f"the order, names, shapes or dtypes of their parameters (rank(s) "
                       f"{ranks_unlike_0('layout')} unlike rank 0's; param groups built from a "
                       "set() come out in another order on each rank)")
        elif ranks_unlike_0("trainable"):
            out.append(f"which of their parameters are trainable (requires_grad differs on "
                       f"rank(s) {ranks_unlike_0('trainable')} from rank 0: freeze the same "
                       "parameters on every rank before building the optimizer)")
        if ranks_unlike_0("freeze_step"):
            out.append("freeze_step (" + ", ".join(
                f"rank {r}: {'auto' if s.freeze_step < 0 else s.freeze_step}"
                for r, s in enumerate(everyone)) + ")")
        if ranks_unlike_0("options"):
            named = [name for i, name in enumerate(self.option_names)
                     if any(s.options[i] != everyone[0].options[i] for s in everyone)]
            out.append(f"{', '.join(named)} (rank(s) {ranks_unlike_0('options')} unlike rank "
                       "0's)")
        return out


def check_same_job(mine: JobSignature, gather: Callable[[torch.Tensor], torch.Tensor],
                   who: str) -> None:
    """Raise on every rank unless every rank's optimizer has the same parameters in the same
    order and the same options. ``gather``: int64 [1, k] -> [ranks, k], every rank's row in
    rank order (one allgather)."""
    rows = gather(torch.tensor([mine.row()], dtype=torch.int64)).tolist()
    differences = mine.differences([mine.from_row(row) for row in rows])
    if differences:
        raise ValueError(f"{who}: the ranks' optimizers differ in {'; and in '.join(differences)}"
                         ": build it alike on every rank (the same parameters in the same "
                         "order, the same options)")


#: The bytes of one rank's refusal the construction's agreement carries (its longer messages
#: arrive cut, with "...").
REFUSAL_BYTES = 2048

Gather = Callable[[torch.Tensor], torch.Tensor]


@contextmanager
def refused_on_every_rank(gather: Callable[[], Optional[Gather]], who: str):
    """The block's checks are each rank's own; at its end (or at its first refusal) one
    allgather tells every rank whether another refused, and then every rank raises: the rank
    that refused its own error, the others one of the same type that names that rank and
    quotes its message. Without it the other ranks would wait in the next collective (a
    connection error, or a hang under NCCL). ``gather()``: the allgather, uint8 [1, k] ->
    [ranks, k] in rank order, or None where no other rank takes part (one rank, an elastic
    worker joining a running job); called after the block, which may have found the group."""
    try:
        yield
    except Exception as error:
        try:
            exchange = gather()
        except Exception:  # no group to agree on: the error says more than a failed gather
            raise error from None
        if exchange is not None:
            try:
                exchange(refusal_row(error))
            except Exception as failed:  # the refusal is what the user needs to read
                raise error from failed
        raise
    exchange = gather()
    if exchange is not None:
        raise_refusals(exchange(refusal_row(None)).tolist(), who)


def refusal_row(error: Optional[Exception]) -> torch.Tensor:
    """uint8 [1, REFUSAL_BYTES]: the error's type and message in UTF-8 (zeros: none)."""
    row = torch.zeros((1, REFUSAL_BYTES), dtype=torch.uint8)
    if error is not None:
        kind = next(k for k in type(error).__mro__  # the nearest builtin: catchable alike
                    if getattr(builtins, k.__name__, None) is k)
        text = f"{kind.__name__}\0{error}".encode()
        if len(text) > REFUSAL_BYTES:
            text = text[:REFUSAL_BYTES - 3] + b"..."
        row[0, :len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    return row


def raise_refusals(rows: list[list[int]], who: str) -> None:
    """Raise the first refusal among every rank's :func:`refusal_row` (as lists), if any."""
    refused = [(r, bytes(row).rstrip(b"\0").decode(errors="replace"))
               for r, row in enumerate(rows) if any(row)]
    if not refused:
        return
    rank, text = refused[0]
    kind, _, message = text.partition("\0")
    message = message.removeprefix(f"{who}: ")  # the face is named once
    more = (f" (rank(s) {[r for r, _ in refused[1:]]} refused too)" if len(refused) > 1
            else "")
    message = f"rank {rank} refused to build {who}{more}: {message}"
    kind = getattr(builtins, kind, None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind = RuntimeError
    try:
        error = kind(message)
    except Exception:  # a builtin taking more than a message (UnicodeDecodeError)
        error = RuntimeError(message)
    raise error


def check_same_parameters(param_groups: list[dict], names: Mapping[torch.Tensor, str], config,
                          process_set) -> None:
    """:func:`check_same_job` through Horovod."""
    import horovod.torch as hvd

    check_same_job(JobSignature.of(param_groups, names, config),
                   lambda t: hvd.allgather(t, name="hvd_onebit.param_signature",
                                           process_set=process_set),
                   "hvd_onebit.DistributedOptimizer")


def parameter_bit_sums(param_groups: list[dict], step: int) -> torch.Tensor:
    """[1, 1 + k] int64: the step count, then the sum of each parameter's bits (as integers),
    in param-group order."""
    sums = []
    for g in param_groups:
        for p in g["params"]:
            flat = p.detach().reshape(-1)
            bits = flat.view(torch.int16 if flat.element_size() == 2 else torch.int32)
            sums.append(bits.to(torch.int64).sum())
    device = sums[0].device if sums else torch.device("cpu")
    return torch.stack([torch.tensor(step, dtype=torch.int64, device=device)] + sums
                       ).reshape(1, -1)


def raise_if_diverged(everyone: torch.Tensor, step: int, check_every: int) -> None:
    """``everyone``: every rank's :func:`parameter_bit_sums`, one row per rank in rank order."""
    steps = everyone[:, 0].tolist()
    if len(set(steps)) > 1:
        raise RuntimeError(
            f"hvd_onebit: the ranks are at different step counts ({steps}, in rank order; "
            f"check_every={check_every}): a checkpoint loaded on some ranks only? Load it on "
            "every rank, or on rank 0 and then send it to the others (hvd.broadcast_parameters "
            "and hvd.broadcast_optimizer_state)")
    differ = [r for r in range(everyone.shape[0]) if not torch.equal(everyone[r], everyone[0])]
    if differ:
        raise RuntimeError(
            f"hvd_onebit: parameters diverged across ranks at step {step}: "
            f"rank(s) {differ} differ from rank 0 (check_every={check_every}). Something a "
            "script does on some ranks only parts them: a learning rate, weight decay or "
            "scheduler set per rank, gradients changed on some ranks after they were averaged "
            "(a clip on one rank), a parameter or the optimizer's state written on some ranks")


def check_parameters_identical(param_groups: list[dict], process_set, step: int,
                               check_every: int) -> None:
    """Raise on every rank if the parameters are no longer bit-identical across ranks (a sum of
    each parameter's bits, compared after one Horovod allgather)."""
    import horovod.torch as hvd

    everyone = hvd.allgather(parameter_bit_sums(param_groups, step), name="hvd_onebit.consistency",
                             process_set=process_set)
    raise_if_diverged(everyone, step, check_every)
