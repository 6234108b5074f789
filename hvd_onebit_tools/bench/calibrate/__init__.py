"""Measure the constants of the scale model (:mod:`hvd_onebit_tools.bench.predict`) on this machine.

Three groups, saved together as one JSON file (``hvd-onebit bench calibrate --out FILE``):

* **compute** (no Horovod): for ``k`` processes running at once on this machine's cores
  (``k`` in ``--procs``, default 1, 2, 4), each with one torch thread as a rank has, the
  bench models' whole step (forward, backward, fused Adam) run free, as `bench train`'s
  ``local`` ranks run it, then forward+backward and Adam's step each timed with all k processes
  in the same phase (ranks synchronised by collectives run them so, and contend more for cores
  and memory), and the 1-bit kernels' time per element (momentum + compress, server step,
  decode + update), in lock-step too; and the hierarchical collective's passes (momentum
  written out, the node mean inside the shard's compression, a float32 add, plain compress and
  decode, the copy-out with Adam's update). ``k = 1`` is a rank with a core to itself; larger ``k``
  is what ranks that share cores (the emulator) get.
* **collectives** (Horovod over Gloo on the emulated cluster, every rank its own link): the
  time of a tiny allreduce, alltoall and allgather (the per-op cost: negotiation, size
  exchanges, per-peer messages), and of large fp32 and fp16 allreduces, alltoalls and
  allgathers, at ``--np`` ranks, first on unshaped links (the host's own cost per byte:
  reductions, copies, the TCP stack) then on shaped links of ``--link`` (the link's efficiency:
  payload bytes per second over the nominal rate). The same jobs time the 1-bit stages as
  ``transport="torch"`` runs them (:class:`~hvd_onebit.transports.TorchTransport`:
  torch.distributed's Gloo alltoall and allgather, no Horovod negotiation), tiny and large,
  under ``torch_*`` keys; and the bench models' compute and the 1-bit kernels as the ranks of
  those jobs run them (next to Horovod's background thread, every rank in the same phase),
  which `bench predict --colocated` prefers to the bare processes' figures.
* **machine**: cores, and the date.

Every timed collective starts after a barrier; a call's time is the slowest rank's (the op ends
when its last rank is done); the median of ``repeats`` calls is kept.

The modules, one job each:

* :mod:`.workloads`: what is timed (the bench models' step, the 1-bit kernels' calls);
* :mod:`.compute`: the compute group, timed in bare processes sharing the cores;
* :mod:`.ranks`: what runs inside the ranks of a Horovod job (the collectives, and compute and
  kernels as those ranks run them);
* :mod:`.run`: the whole calibration, with the collectives' jobs on the emulated cluster;
* :mod:`.files`: the calibration file: its versions, where it is saved and loaded from.
"""
