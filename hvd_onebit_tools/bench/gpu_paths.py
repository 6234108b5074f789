"""The GPU check's runs of the engine's paths beyond one plain step, and of the kernels past 2**31
elements (``benchmarks/gpu_check.py``: ``engine_paths``, ``gradient_paths``, ``wide``).

``engine_paths``: the compression engine (``CompressedStep``) on 2 virtual ranks, one run on the
device and the same run on CPU with the native kernels, each taking in turn
- steps of ``step()`` alone;
- steps whose buckets start early (``begin_step``, then ``start_bucket`` for each, as the
  overlap's gradient hooks start them), then ``step()``;
- steps with ``lr`` and ``betas`` as tensors on the device (fused or capturable Adam's), the
  host syncs of the steady one counted on CUDA;
- ``flush_error_feedback`` summed in pieces that cut across the parameters.
After each stage: whether the ranks hold the same parameters, and whether the device's bits are
the CPU's.

``gradient_paths``: the full-precision step's non-finite flag (one foreach norm in float32)
over float32, float16, bfloat16 and sparse gradients on the device, against the flag each list
should give, and whether computing it for dense gradients syncs with the host (it must not: the
flag travels unread in the ranks' agreement); and where a gradient's storage starts
(``storage_of``, the overlap's key for gradients that share a version counter) for views,
offsets and empty views on the device, against the storage's own data pointer.

``wide``: the worker compression and the decode of one buffer of more than 2**31 elements,
where the Triton kernels take int64 positions: the bits of the CPU's reference kernels. The
fused passes (the momentum inside the compression, Adam's update inside the decode) share
those kernels' positions but are not run at that size (their tensors would take about twice
the memory).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

STAGES = ("alone", "early", "tensor_options", "flushed_in_pieces")


def tensors_bytes(tensors) -> bytes:
    """The tensors' bytes (of one dtype), one after the other (copied to the host)."""
    import torch
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).cpu()
    return flat.view(torch.uint8).numpy().tobytes()


@contextmanager
def _flush_piece(elements: int):
    """The flush summed in pieces of ``elements`` (a model larger than a piece is flushed so)."""
    from hvd_onebit.engine import error_feedback
    saved = error_feedback.FLUSH_PIECE
    error_feedback.FLUSH_PIECE = elements
    try:
        yield
    finally:
        error_feedback.FLUSH_PIECE = saved


def layered_engine(t, device: str, width: int, layers: int, decoupled: bool = False) -> tuple:
    """(params, state, engine): ``layers`` weight matrices of ``width``^2 with their biases on
    ``device``, an Adam state as after 10 steps (the same on every rank, step counts on the
    device as fused or capturable Adam keeps them), and a CompressedStep over them on
    transport ``t`` with a bucket per weight matrix (each bias packed behind its weight)."""
    import torch
    from hvd_onebit.config import OneBitConfig
    from hvd_onebit.engine import NOT_FROZEN, CompressedStep

    g = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(layers) for s in ((width, width), (width,))]
    params = [torch.randn(s, generator=g).to(device) for s in shapes]
    state = {p: {"step": torch.tensor(10.0, device=device),
                 "exp_avg": (torch.randn(p.shape, generator=g) * 1e-3).to(device),
                 "exp_avg_sq": (torch.rand(p.shape, generator=g) * 1e-6 + 1e-9).to(device),
                 "frozen_variance_step": NOT_FROZEN} for p in params}
    config = OneBitConfig.from_options(
        freeze_step=10, bucket_size_mb=(width * width + width) * 4 / 2**20)
    engine = CompressedStep(config, state, decoupled=lambda group: decoupled, transport=t)
    return params, state, engine


def _engine_run(t, device: str, width: int, layers: int, gate, syncs: dict) -> dict:
    """One rank's run of :data:`STAGES` on ``device``: the parameters' bytes after each."""
    import torch
    from hvd_onebit_tools.bench.syncs import SyncRecorder

    params, _, engine = layered_engine(t, device, width, layers, decoupled=True)
    groups = [{"params": params, "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
               "weight_decay": 0.01}]

    def grads(step: int) -> dict:
        gen = torch.Generator().manual_seed(1000 * step + t.rank)
        return {p: (torch.randn(p.shape, generator=gen) * 1e-3).to(device) for p in params}

    def step(k: int, early: bool = False, counted: bool = False) -> None:
        engine.ensure_ready(params)
        found = grads(k)
        if counted:
            gate.wait()
            if t.rank == 0:
                torch.cuda.synchronize()
                syncs["recorder"] = SyncRecorder().__enter__()
            gate.wait()
        try:
            if early:
                engine.begin_step()
                for _ in engine.buckets:
                    engine.start_bucket(groups, found)
            engine.step(groups, found)
        finally:
            if counted:  # both ranks past the step before the recorder stops, and both wait
                gate.wait()  # for it to stop before their next read of a device value
                if t.rank == 0:
                    syncs["recorder"].__exit__(None, None, None)
                gate.wait()

    out = {}
    for k in range(2):
        step(k)
    out["alone"] = tensors_bytes(params)
    for k in range(2, 4):
        step(k, early=True)
    out["early"] = tensors_bytes(params)
    groups[0]["lr"] = torch.tensor(1e-3, device=device)
    groups[0]["betas"] = (torch.tensor(0.9, device=device), torch.tensor(0.999, device=device))
    step(4, early=True)  # the options read once
    step(5, early=True, counted=device == "cuda")
    out["tensor_options"] = tensors_bytes(params)
    engine.flush_error_feedback(groups)  # in pieces (check_engine_paths sets their size)
    out["flushed_in_pieces"] = tensors_bytes([*params, *(b.momentum for b in engine.buckets)])
    out["buckets"], out["early_starts"] = len(engine.buckets), engine.early_starts
    return out


def check_engine_paths(device: str, width: int = 1024, layers: int = 3) -> dict:
    """See the module's docstring; ok when the ranks agree and the device gives the CPU's bits
    after every stage, every bucket started early, and (on CUDA) the steady step with tensor
    options synced at most once outside the in-process transport."""
    from hvd_onebit.transport.inprocess import run_threads

    def runs(dev: str) -> tuple[list, dict]:
        gate, syncs = threading.Barrier(2, timeout=300), {}
        return run_threads(2, lambda t: _engine_run(t, dev, width, layers, gate, syncs),
                           timeout=600), syncs

    with _flush_piece(4099):  # set once for both threads
        here, syncs = runs(device)
        cpu, _ = runs("cpu")
    out = {"ranks": 2, "buckets": here[0]["buckets"], "early_starts": here[0]["early_starts"],
           "stages": {s: {"ranks_identical": here[0][s] == here[1][s],
                          "equal_to_cpu": here[0][s] == cpu[0][s]} for s in STAGES}}
    ok = all(v["ranks_identical"] and v["equal_to_cpu"] for v in out["stages"].values())
    ok &= out["buckets"] > 1 and out["early_starts"] == 4 * out["buckets"]
    if "recorder" in syncs:
        out["tensor_options_step"] = syncs["recorder"].summary(2)
        ok &= out["tensor_options_step"]["host_syncs_per_rank"] <= 1
    out["ok"] = bool(ok)
    return out


def _flag_cases(device: str) -> dict:
    """Lists of gradients on ``device`` by name, each with the flag it should give."""
    import torch

    def t(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    inf, nan = float("inf"), float("nan")
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, inf], (4,), device=device,
                                     check_invariants=True)
    return {
        "finite_mixed": ([t([1.0, -2.0]), t([3.0], torch.float16), t([4.0], torch.bfloat16)],
                         False),
        "inf_float32": ([t([1.0]), t([inf, 1.0])], True),
        "nan_float16": ([t([1.0]), t([nan], torch.float16)], True),
        "inf_bfloat16": ([t([-inf, 0.0], torch.bfloat16), t([2.0])], True),
        "float16_past_its_range": ([t([60000.0] * 4, torch.float16)], False),
        "sparse_inf": ([t([1.0]), sparse], True),
    }


def check_gradient_paths(device: str) -> dict:
    """See the module's docstring; ok when every flag is the expected one, none synced (on
    CUDA), and every storage start is the storage's own."""
    import torch
    from hvd_onebit.overlap import storage_of
    from hvd_onebit.phases.gradients import nonfinite_flag

    cases, flags = _flag_cases(device), {}
    recorder = None
    if device == "cuda":
        from hvd_onebit_tools.bench.syncs import SyncRecorder
        torch.cuda.synchronize()
        recorder = SyncRecorder().__enter__()
    try:  # the dense cases: a sparse gradient is coalesced first, which syncs on CUDA
        computed = {name: nonfinite_flag(tensors) for name, (tensors, _) in cases.items()
                    if not any(t.is_sparse for t in tensors)}
    finally:
        if recorder is not None:
            recorder.__exit__(None, None, None)
    computed.update((name, nonfinite_flag(tensors)) for name, (tensors, _) in cases.items()
                    if name not in computed)
    for name, (_, expected) in cases.items():
        flags[name] = {"flag": bool(computed[name]), "expected": expected,
                       "device": computed[name].device.type}
    base = torch.zeros(6, 5, device=device)
    views = {"whole": base, "row": base[3], "column": base[:, 2], "offset": base.view(-1)[7:],
             "empty": base[2:2]}
    start = base.untyped_storage().data_ptr()
    storages = {name: storage_of(v) == start for name, v in views.items()}
    out = {"flags": flags, "storage_of_equals_storage": storages,
           "flag_syncs": recorder.summary() if recorder is not None else None}
    ok = all(f["flag"] == f["expected"] and f["device"] == device for f in flags.values())
    ok &= all(storages.values())
    if recorder is not None:
        ok &= out["flag_syncs"]["host_syncs_per_rank"] == 0
    out["ok"] = bool(ok)
    return out


def check_wide(device: str = "cuda", numel: int = (1 << 31) + 4099, n: int = 2) -> dict:
    """See the module's docstring: Triton's worker compression and decode on the device at
    ``numel`` elements (the default layout), each output against the CPU reference kernels'
    on copies of the same inputs (made on the device, which is quicker)."""
    import torch
    from hvd_onebit import kernels
    from hvd_onebit.config import DEFAULT_BLOCK_SIZE
    from hvd_onebit.kernels.native_loader import load_native
    from hvd_onebit.kernels.triton.launch import wide
    from hvd_onebit.layout import Layout

    L = Layout.build(numel, n, DEFAULT_BLOCK_SIZE)
    g = torch.Generator(device=device).manual_seed(numel)
    inputs = (torch.randn(numel, generator=g, device=device),
              torch.randn(L.padded, generator=g, device=device),
              torch.rand(L.n * L.nblocks, generator=g, device=device))

    def run(backend: str, x, y_prev, prev_scales) -> tuple:
        dev = x.device
        y_out = torch.empty(L.padded, device=dev)
        send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8, device=dev)
        finite = bool(kernels.worker_compress(x, y_prev, prev_scales, y_out, send, L, backend))
        out = torch.empty(numel, device=dev)
        kernels.decode(send, out, L, backend)
        return finite, y_out.cpu(), send.cpu(), out.cpu()

    found = run("triton", *inputs)
    host = [t.to("cpu", copy=True) for t in inputs]
    del inputs
    if device == "cuda":
        torch.cuda.empty_cache()
    reference = "native" if load_native().module is not None else "torch"
    expected = run(reference, *host)
    del host
    names = ("finite", "y", "rows", "decoded")
    same = {k: (a == b if k == "finite" else bool(torch.equal(a, b)))
            for k, a, b in zip(names, found, expected)}
    return {"ok": all(same.values()), "numel": numel, "n": n, "block": DEFAULT_BLOCK_SIZE,
            "wide": wide(L.n * L.nblocks, L.block), "reference": f"{reference} kernels on CPU",
            "equal_to_cpu": same}
