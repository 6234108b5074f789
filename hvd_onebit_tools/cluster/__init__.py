"""A bandwidth-limited cluster on one machine: ranks (Horovod or torchrun) on rate-limited links.

* :mod:`.bandwidth`: link rates (``"1gbit"``) and the tbf token bucket that enforces them;
* :mod:`.system`: privileges, the ``ip``/``tc`` commands, interface counters;
* :mod:`.network`: namespaces, veth links, the bridge, tbf qdiscs, and the clean-up of networks
  whose owner died;
* :mod:`.rendezvous`: Horovod's rendezvous server and the ``horovodrun --gloo`` environment;
* :mod:`.launcher`: :class:`EmulatedCluster`, which runs a command on every host as one job;
* :mod:`.processes`: a run's processes, started, pumped and killed together;
* :mod:`.torchrun`: DDP jobs launched with one torchrun per node, as on a multi-node cluster;
* :mod:`.results`: what a run did (:class:`RunResult`, :class:`RankResult`);
* :mod:`.cli`: ``hvd-onebit cluster run``.

Needs root (network namespaces). Nothing here imports Horovod until a Horovod job runs.
"""
from .bandwidth import TbfParams, format_bandwidth, parse_bandwidth, tbf_params
from .launcher import EmulatedCluster
from .network import MAX_RANKS, cleanup_stale
from .results import RankResult, RunResult
from .system import EmulatorError, check_privileges

__all__ = [
    "EmulatedCluster", "EmulatorError", "MAX_RANKS", "RankResult", "RunResult", "TbfParams",
    "check_privileges", "cleanup_stale", "format_bandwidth", "parse_bandwidth", "tbf_params",
]
