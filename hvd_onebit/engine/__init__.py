"""The engine: 1-bit Adam's compression phase over Adam's state, without Horovod's optimizer.

``step`` (:class:`CompressedStep`: buckets, collectives, one step as a transaction),
``fusion`` (momenta in one flat buffer cut into buckets), ``adam_terms`` (what the fused passes
are fed), ``variance`` (the frozen variance), ``error_feedback`` (saved, restored, flushed) and
``refresh`` (a variance refresh: Adam's full-precision step, the errors carried over).
Below it: :mod:`hvd_onebit.comm`.
"""
from .step import BREAKDOWN, CompressedStep, process_set_size
from .variance import NOT_FROZEN

__all__ = ["BREAKDOWN", "NOT_FROZEN", "CompressedStep", "process_set_size"]
