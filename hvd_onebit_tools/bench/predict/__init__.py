"""A calibrated scale model of a training step: Horovod fp32 / fp16 Adam, flat 1-bit Adam and
hierarchical 1-bit Adam at any number of ranks, from constants measured on one machine
(:mod:`hvd_onebit_tools.bench.calibrate`).


The modules, one job each:

* :mod:`.constants`: the model's constants from a calibration file (per-op costs, host cost
  per byte, overlap of host and wire);
* :mod:`.job`: what is predicted (the cluster, the job) and what a prediction holds;
* :mod:`.model`: :class:`~.model.Model`, the step time per phase of each method;
* :mod:`.sweep`: predictions over world sizes and bandwidths, and where the methods cross;
* :mod:`.runs`: whole runs counted in steps, with a ``variance_refresh`` schedule against a
  fixed warmup, and their sweep over run lengths;
* :mod:`.check`: predictions paired with `bench train --json` measurements;
* :mod:`.tables` and :mod:`.plots`: what `bench predict` prints and draws.

The model (docs/predicting.md says the same in prose):

* A step is its phases, one after another (no overlap of compute and communication):
  ``compute`` (forward + backward + the optimizer's own pass), then the method's collectives and
  kernels. 1-bit Adam's compressed step replaces Adam's pass by its two fused kernels (momentum +
  compress, decode + update) and the server step.
* A collective of ``b`` bytes per rank on a link of rate ``R``::

      t = alpha_op(n) + steps * latency + max(host, wire) + kappa * min(host, wire)
      wire = bytes on the busiest link * 8 / (R * TCP_EFFICIENCY)      host = h_op(n) * b

  ``alpha_op(n) = a_op + b_op * (n - 1)``: Horovod's cost per op (negotiation, size exchanges,
  one message per peer), a line through the tiny-op times measured at two world sizes.
  ``h_op``: the host's cost per byte (reduction, copies, TCP stack), measured on unshaped links
  (for Horovod's fp16 allreduce of a calibrated bench model: on that model's own gradient, as
  float16 subnormals make its cost depend on the values);
  ``kappa``: the share of the shorter of host and wire time that the longer one does not hide
  (the ring pipelines its chunks), from the large fp32 allreduce on a shaped link; Horovod's
  fp16 allreduce has its own, from the fp16 allreduce there (``Compression.fp16`` casts the
  whole buffer before and after the ring, outside its pipeline).
* Ring allreduce: ``2 (n-1)/n B`` per rank, ``2 (n-1)`` latency steps; alltoall and allgather of
  rows of ``r`` bytes: ``(n-1) r`` per rank (alltoall: one latency, its messages go at once;
  ring allgather: ``n-1``). With ``L`` ranks per node the node's link carries ``L (n-L) r`` in the
  alltoall and the ring's ``2 (n-1)/n B`` (one ring crossing per node boundary).
* Flat 1-bit's two stages are costed with the constants of the transport that runs them:
  torch.distributed's Gloo alltoall and allgather (``transport="torch"``, what ``"auto"``
  picks on CPU) or Horovod's.
* Hierarchical 1-bit as ``hvd_onebit/comm/hierarchical.py`` runs it
  (:meth:`.model.Model._hierarchical`), on the same transport as flat 1-bit: with ``"torch"``,
  the two 1-bit stages of the shard ``|m|/L`` as torch.distributed collectives of the ``N``
  ranks with the same local rank, and the full-precision scatter and gather inside the node
  through shared memory (``intra_node="shared_memory"``: a barrier each, what CPU ranks do) or
  the node's links (``"network"``: NVLink, PCIe); with ``"horovod"``, four global Horovod
  alltoalls with splits. Its passes are the native kernels it runs (momentum written out, node
  mean inside the shard's compression, decode, copy-out with Adam's update).
* Ranks that share this machine's cores (``colocated``, the emulator) run compute and kernels
  as timed inside the calibration's Horovod ranks (else: bare processes sharing the cores), in
  lock-step: collectives start every rank's phase together (``bench train``'s ``local`` ranks
  run free, so it is predicted with the free-running step); otherwise a rank has a core to
  itself.
* Whole run: ``warmup_frac`` of the steps at the warmup step time (Horovod's fp32 allreduce),
  the rest at the compressed step time. Counted in steps (:mod:`.runs`): a run of ``S`` steps
  frozen at ``F`` with ``R`` refreshes of a ``variance_refresh`` schedule takes ``F + R`` steps
  at the fp32 step time (a refresh step is the warmup's step) and ``S - F - R`` compressed.
"""
