"""What one run of a command on the emulated cluster did: per-rank status, bytes and output."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from .bandwidth import format_bandwidth


@dataclass
class RankResult:
    """What one rank did during one :meth:`EmulatedCluster.run`.

    ``exit_code``: the command's exit status as a shell reports it (128 + N if killed by signal N);
    ``killed``: it was still running when the emulator killed the job (another rank failed,
    timeout, interrupt); it may still have exited with its own status in the grace period. It
    gets SIGTERM once its command has started (a rank still in its set-up gets it when the set-up
    is done), so it reports 143 unless its command handles SIGTERM, or 137 if it was still
    running at the end of the grace period;
    ``tx_bytes`` / ``rx_bytes``: bytes the rank's host sent / received on its link during the run
    (Ethernet frames, so including TCP/IP headers and Horovod's control traffic); on a node of
    several ranks, an even share of the node's bytes (the link is the node's, not the rank's);
    ``output``: its stdout and stderr, interleaved; ``log_path``: where that was also written.
    """

    rank: int
    hostname: str
    address: str
    exit_code: Optional[int]
    killed: bool
    tx_bytes: int
    rx_bytes: int
    output: str = field(repr=False, default="")
    log_path: Optional[str] = None


@dataclass
class RunResult:
    """One command run on every rank. ``wall_seconds``: launch to last rank's exit;
    ``node_bytes``: (tx, rx) bytes of each node's link, i.e. the traffic between nodes;
    ``launches``: "rank" when ``ranks`` holds one entry per rank (Horovod's ranks, started by
    the emulator), "node" when it holds one per node (a launcher such as torchrun, which
    started the node's ranks itself; its bytes are the node's whole link)."""

    ranks: list[RankResult]
    wall_seconds: float
    bandwidth_bps: Optional[int]
    timed_out: bool = False
    first_failed_rank: Optional[int] = None
    node_bytes: list[tuple[int, int]] = field(default_factory=list)
    ranks_per_node: int = 1
    launches: str = "rank"

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.exit_code == 0 for r in self.ranks)

    @property
    def np(self) -> int:
        """The ranks of the job (entries times ranks per node with one launch per node)."""
        return len(self.ranks) * (self.ranks_per_node if self.launches == "node" else 1)

    @property
    def returncode(self) -> int:
        """0 on success, 124 on timeout, else the exit code of the first rank that failed."""
        if self.timed_out:
            return 124
        if self.first_failed_rank is not None:
            return self.ranks[self.first_failed_rank].exit_code or 1
        return next((r.exit_code or 1 for r in self.ranks if r.exit_code != 0), 0)

    @property
    def tx_bytes(self) -> int:
        return sum(r.tx_bytes for r in self.ranks)

    def to_dict(self, with_output: bool = False) -> dict:
        ranks = [asdict(r) for r in self.ranks]
        if not with_output:
            for r in ranks:
                r.pop("output")
        return {"np": self.np, "ranks_per_node": self.ranks_per_node,
                "launches": self.launches,
                "node_bytes": [list(b) for b in self.node_bytes],
                "bandwidth": format_bandwidth(self.bandwidth_bps),
                "bandwidth_bps": self.bandwidth_bps, "wall_seconds": round(self.wall_seconds, 3),
                "timed_out": self.timed_out, "first_failed_rank": self.first_failed_rank,
                "returncode": self.returncode, "ranks": ranks}
