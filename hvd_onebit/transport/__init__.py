"""Transports: the two collectives the 1-bit allreduce needs, over Horovod, mpi4py,
torch.distributed or threads.

A transport moves bytes and nothing else: ``alltoall`` of n equal rows (stage 1) and ``allgather``
of one row (stage 2), each with an async start and a wait, plus a small int allgather for the
layout check (:class:`~hvd_onebit.transport.base.Transport` names exactly that).

* :mod:`.base`: the ``Transport`` protocol, and ``JobTransport``: what the compression phase
  needs of the job beyond the stages (an exact sum, the node layout).
* :mod:`.registry`: the transports by name (``TRANSPORTS``), what each can carry, "auto"
  (``resolve_transport``), the checks, ``make_transport`` and ``job_transport``. Imports no
  Horovod.
* :mod:`.horovod`: Horovod's (the default; Gloo, MPI or NCCL, CPU or GPU tensors),
  ``sleep_until_done``, the sleeping wait on a Horovod handle, and ``HorovodJob``, the
  compression phase's transport in a Horovod job.
* :mod:`.mpi`: mpi4py's MPI_Ialltoall / MPI_Iallgather on (a duplicate of) Horovod's
  communicator; MPI jobs, CPU tensors.
* :mod:`.torch_distributed`: torch.distributed's (Gloo for CPU, NCCL for CUDA; the default group
  or subgroups, ``torch_subgroups``); :mod:`.rendezvous` sets up its default group over
  Horovod's ranks (``init_torch_distributed``).
* :mod:`.inprocess`: n virtual ranks as threads of one process (``InProcessWorld``,
  ``run_threads``).

Import the names from their modules; this package imports none of them.
"""
