"""The engine: 1-bit Adam's compression phase over Adam's state, without Horovod's optimizer.

``step`` (:class:`CompressedStep`: the orchestration of the parts below), ``fusion`` (momenta in
one flat buffer cut into buckets, :class:`~.fusion.FusedBuckets`), ``collectives`` (one 1-bit
collective per bucket), ``averaging`` (a step's exchange: early starts, one transaction),
``adam_terms`` (what the fused passes are fed), ``variance`` (the frozen variance),
``error_feedback`` (saved, restored, flushed) and ``refresh`` (a variance refresh: Adam's
full-precision step, the errors carried over). Below it: :mod:`hvd_onebit.comm`.
"""
from ..transport.base import process_set_size
from .averaging import BREAKDOWN
from .step import CompressedStep
from .variance import NOT_FROZEN

__all__ = ["BREAKDOWN", "NOT_FROZEN", "CompressedStep", "process_set_size"]
