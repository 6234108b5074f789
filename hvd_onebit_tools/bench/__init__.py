"""Benchmarks of 1-bit Adam: ``hvd-onebit bench train | allreduce | calibrate | predict``,
``hvd-onebit bench dev kernel | memory | zoo`` and ``make demo``.

* :mod:`.cli`: the ``bench`` commands (tables by default, JSON with ``--json``);
* :mod:`.kernel`, :mod:`.allreduce`, :mod:`.train`: the measurements, each returning plain dicts
  ready for JSON (the allreduce and train workers run inside every rank of a job);
* :mod:`.lm`: ``examples/train_lm.py`` as a job, for :mod:`.demo` and ``benchmarks/convergence.py``;
* :mod:`.demo`: ``make demo``, Horovod Adam vs 1-bit Adam on an emulated cluster;
* :mod:`.report`: machine information and plain-text tables.
"""
