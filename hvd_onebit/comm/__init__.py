"""Communication: the 1-bit collectives and the transaction that drives their stages.

``protocol`` (the stage protocol, the hooks, status words and errors), ``transaction``
(:func:`synchronize_all`: several calls commit together or not at all), ``flat``
(:class:`OneBitAllreduce`, with its error feedback in ``flat_error``), ``hierarchical`` (1-bit
between nodes, full precision inside them) and ``topology`` (who shares a node). Below: the
kernels (:mod:`hvd_onebit.kernels`) and the transports (:mod:`hvd_onebit.transport`).
"""
