"""A rank lost while its node maps the shared-memory segment of the hierarchical collective:
local rank 1 dies inside ``torch.from_file`` (as a rank killed there by the OOM killer or a
preemption would), after local rank 0 created the segment and before every rank had mapped it.

    torchrun --standalone --nproc_per_node 2 shm_lost_rank.py

Rank 0 prints one JSON line with what the node's exchange raised; the segment's folder
(``HVD_ONEBIT_SHM_DIR``) is left for the caller to look into.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from hvd_onebit.transport.shared_memory import SharedMemoryTransport
from hvd_onebit.transport.torch_distributed import torch_subgroups


def main() -> None:
    dist.init_process_group("gloo")
    torch_subgroups([(0, 1)])
    if dist.get_rank() == 1:
        mapped = torch.from_file

        def lost(path, *args, **kwargs):
            if "hvd_onebit-" in str(path):
                os._exit(9)
            return mapped(path, *args, **kwargs)

        torch.from_file = lost
    try:
        SharedMemoryTransport(members=(0, 1), shard=4096)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"rank": dist.get_rank(), "error": error,
                      "left": sorted(os.listdir(os.environ["HVD_ONEBIT_SHM_DIR"]))}), flush=True)


if __name__ == "__main__":
    main()
