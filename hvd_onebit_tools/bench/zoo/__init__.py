"""The convergence zoo: Horovod Adam against 1-bit Adam on model families nobody
tuned for, 4 ranks, every cell's final held-out loss over Adam's on the same seed.

``hvd-onebit bench dev zoo`` (or ``python benchmarks/zoo.py``) runs it; the modules, one job each:

* ``data.py``: the data sets, made from a seed (no downloads);
* ``models.py``: the families (network, data, loss, batch sampler, held-out loss);
* ``grid.py``: the cells (families x learning-rate rules x seeds x Adam or freeze settings x
  schemes; a scheme is a dict of extra ``hvd_onebit.DistributedOptimizer`` options);
* ``worker.py``: inside one Horovod job, trains cells one after another, one JSON line each;
* ``runner.py``: one job per family through :func:`hvd_onebit_tools.cluster.jobs.run_job`, resumable;
* ``report.py``: ratios to Adam, divergences, per-scheme targets, a table, JSON and a heat map.
"""
