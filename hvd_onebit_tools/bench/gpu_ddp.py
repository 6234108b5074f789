"""The DDP face on CUDA tensors, run under torchrun by ``benchmarks/gpu_check.py``:

    torchrun --nproc_per_node 2 -m hvd_onebit_tools.bench.gpu_ddp --backend gloo

Each rank trains the same MLP (on ``cuda:local_rank % device_count``, so ranks share a GPU
where there is one) twice from the same start: DDP + Adam, then DDP + the same Adam wrapped by
:func:`hvd_onebit.ddp.DistributedOptimizer`, through the warmup into the compression phase.
Rank 0 prints one line, ``GPU_DDP_JSON {...}``: per optimizer the first and last losses, whether
the ranks' parameters are identical, the phase reached, the mean step time of the last steps and
(1-bit only) the host syncs of each of the last three steps (``torch.cuda.set_sync_debug_mode``). A
failure prints ``GPU_DDP_JSON {"error": ...}`` on the rank that met it and exits non-zero.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
import traceback

PREFIX = "GPU_DDP_JSON "


def _train(optimizer: str, args, dev, rank: int, size: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvd_onebit.ddp
    from hvd_onebit.engine.fusion import plan_buckets
    from hvd_onebit_tools.bench.syncs import SyncRecorder

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda d: None)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.inputs, args.width), torch.nn.GELU()]
    for _ in range(args.depth - 1):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10)).to(dev)
    model = DDP(net, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if optimizer == "onebit":
        opt = hvd_onebit.ddp.DistributedOptimizer(opt, model, freeze_step=args.freeze_step,
                                                  bucket_size_mb=args.bucket_size_mb)
    teacher = torch.nn.Linear(args.inputs, 10).to(dev)
    with torch.no_grad():
        teacher.weight.copy_(torch.randn(teacher.weight.shape, generator=torch.Generator()
                                         .manual_seed(1)).to(dev))
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    losses, times, syncs = [], [], []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.inputs, generator=g, device=dev)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        sync(dev)
        start = time.perf_counter()
        counting = optimizer == "onebit" and step >= args.steps - 3 and dev.type == "cuda"
        with (SyncRecorder() if counting else contextlib.nullcontext()) as recorder:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        if counting:
            syncs.append({"step": step + 1, **recorder.summary()})
        sync(dev)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    digests = [None] * size
    dist.all_gather_object(digests, digest)
    last = max(1, args.steps // 4)
    out = {"first_loss": losses[0], "last_loss": sum(losses[-last:]) / last,
           "ranks_identical": len(set(digests)) == 1,
           "mean_step_ms_last": 1e3 * sum(times[-last:]) / last,
           "params": int(flat.numel())}
    if optimizer == "onebit":
        telemetry = opt.telemetry()
        out.update(phase=opt.phase, host_syncs_last_steps=syncs,
                   buckets=len(plan_buckets(list(model.parameters()),
                                            int(args.bucket_size_mb * 2**20 / 4))),
                   last_step_bytes=telemetry.get("last_step_bytes"),
                   skipped_steps=telemetry.get("skipped_steps"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="gloo")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--freeze-step", type=int, default=10)
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bucket-size-mb", type=float, default=1.0,
                    help="the 1-bit face's buckets (small: several buckets per step)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the same run on CPU tensors (to try the script without a GPU)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    try:
        if args.device == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))
                               % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        dist.init_process_group(args.backend)
        size = dist.get_world_size()
        report = {"backend": args.backend, "ranks": size, "device": str(dev),
                  "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                  "torch": torch.__version__}
        for optimizer in ("adam", "onebit"):
            report[optimizer] = _train(optimizer, args, dev, rank, size)
        report["ok"] = (report["onebit"]["ranks_identical"] and report["adam"]["ranks_identical"]
                        and report["onebit"]["phase"] == "compression"
                        and report["onebit"]["last_loss"] < report["onebit"]["first_loss"])
    except Exception as exc:  # noqa: BLE001 - the error itself is the report
        print(PREFIX + json.dumps({"ok": False, "rank": rank,
                                   "error": f"{type(exc).__name__}: {exc}"[:2000],
                                   "traceback": traceback.format_exc()[-2000:]}), flush=True)
        return 1
    if rank == 0:
        print(PREFIX + json.dumps(report), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
