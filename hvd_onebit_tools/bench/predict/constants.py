"""The scale model's constants from a calibration file (`bench calibrate`): per op kind the
per-op cost ``alpha`` as a line in the world size, per op and world size the host's cost per
byte and the overlap ``kappa`` of host and wire, and the bench models' and kernels' compute
figures, flat, for printing and for :class:`~.model.Model`."""
from __future__ import annotations

from hvd_onebit.layout import ring_allreduce_bytes

TCP_EFFICIENCY = 1448 / 1514  # TCP payload per Ethernet frame at a 1500-byte MTU
OPS = {"allreduce_fp32": "allreduce", "allreduce_fp16": "allreduce", "alltoall": "alltoall",
       "allgather": "allgather", "alltoall_fp32": "alltoall", "torch_alltoall": "torch_alltoall",
       "torch_allgather": "torch_allgather"}
# the op kinds whose per-op cost is calibrated (tiny ops): Horovod's, then torch.distributed's
KINDS = ("allreduce", "alltoall", "allgather", "torch_alltoall", "torch_allgather")
TRANSPORTS = ("torch", "horovod")
# the ops whose overlap of host and wire (kappa) is measured on the shaped link, and the name
# of the constant; every other op takes the fp32 ring's
KAPPA_OPS = {"allreduce_fp32": "kappa", "allreduce_fp16": "kappa_allreduce_fp16"}


def _line(points: dict[int, float]):
    """a + b (n-1) through the points (least squares; b >= 0); one point gives b = 0."""
    ns = sorted(points)
    if len(ns) == 1:
        return points[ns[0]], 0.0
    xs = [n - 1 for n in ns]
    ys = [points[n] for n in ns]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys))
            / sum((x - mx) ** 2 for x in xs))
    return max(0.0, my - b * mx), b


def _bytes_per_rank(op: str, n: int, numel: int, row: int) -> int:
    if op == "allreduce_fp32":
        return ring_allreduce_bytes(4 * numel, n)
    if op == "allreduce_fp16":
        return ring_allreduce_bytes(2 * numel, n)
    if op == "alltoall_fp32":  # n rows of numel/n floats, n-1 of them sent
        return (n - 1) * (4 * numel // n)
    return (n - 1) * row


def constants(cal: dict) -> dict:
    """The model's constants from a calibration (see :mod:`hvd_onebit_tools.bench.predict`), flat, for
    printing and for :class:`~.model.Model`. Per world size measured: host cost per byte and
    overlap per op."""
    coll = cal["collectives"]
    link, link_bps = cal.get("link"), cal.get("link_bps")
    out: dict = {"cores": cal["cores"], "tcp_efficiency": TCP_EFFICIENCY}
    for kind in KINDS:
        points = {int(n): coll[n]["unlimited"]["median_s"].get(f"{kind}_tiny") for n in coll}
        if None in points.values():
            continue  # a version-2 calibration: no torch.distributed ops
        a, b = _line(points)
        out[f"alpha_{kind}_s"] = a
        out[f"alpha_{kind}_per_peer_s"] = b
    for n, runs in coll.items():
        unl = runs["unlimited"]["median_s"]
        shaped = runs[link]["median_s"] if link in runs and link_bps else None
        numel, row = runs["unlimited"]["numel"], runs["unlimited"]["row_bytes"]
        for op, kind in OPS.items():
            if op not in unl:
                continue
            nbytes = _bytes_per_rank(op, int(n), numel, row)
            host = max(0.0, unl[op] - unl[f"{kind}_tiny"])
            out[f"host_{op}_s_per_byte@{n}"] = host / nbytes
        # kappa: the share of the shorter of host and wire time that the longer does not hide,
        # from the large allreduce on the shaped link (1: no overlap; none measured: 1). The
        # fp32 ring pipelines its reduction with the wire; Compression.fp16 casts the whole
        # buffer before and after the allreduce, outside that pipeline: its own figure.
        for op, key in KAPPA_OPS.items():
            measured = shaped is not None and op in shaped
            if not measured and op != "allreduce_fp32":
                continue  # Model._host takes the fp32 ring's
            kappa = 1.0
            if measured:
                alpha = unl["allreduce_tiny"]
                nbytes = _bytes_per_rank(op, int(n), numel, row)
                host = out[f"host_{op}_s_per_byte@{n}"] * nbytes
                wire = nbytes * 8 / (link_bps * TCP_EFFICIENCY)
                if min(host, wire) > 0:
                    kappa = (shaped[op] - alpha - max(host, wire)) / min(host, wire)
            out[f"{key}@{n}"] = min(1.0, max(0.0, kappa))
    for n, runs in coll.items():
        for model, m in runs.get("unlimited", {}).get("models", {}).items():
            out[f"{model}_step_ms@{n}ranks"] = m["step_s"] * 1e3
            out[f"{model}_fwd_bwd_ms@{n}ranks"] = m["fwd_bwd_s"] * 1e3
            out[f"{model}_adam_ms@{n}ranks"] = m["adam_s"] * 1e3
            if "fp16_allreduce_s" in m:
                out[f"{model}_fp16_allreduce_ms@{n}ranks"] = m["fp16_allreduce_s"] * 1e3
        for name, kern in runs.get("unlimited", {}).get("kernel_s_per_elem", {}).items():
            out[f"kernel_{name}_ns_per_elem@{n}ranks"] = kern * 1e9
    for k, c in cal["compute"].items():
        for name, kern in c["kernel_s_per_elem"].items():
            out[f"kernel_{name}_ns_per_elem@{k}procs"] = kern * 1e9
        for model, m in c["models"].items():
            out[f"{model}_fwd_bwd_ms@{k}procs"] = m["fwd_bwd_s"] * 1e3
            out[f"{model}_adam_ms@{k}procs"] = m["adam_s"] * 1e3
    return out
