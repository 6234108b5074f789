"""What calibration times: `bench train`'s models at their default sizes (one step with
fused Adam on one batch) and the 1-bit kernels as the compressed steps call them."""
from __future__ import annotations

# the bench train models at their default sizes (hvd-onebit bench train --model ...)
BENCH_MODELS = {
    "embedding": {"model": "embedding", "vocab": 32768, "embed_dim": 256, "width": 2048,
                  "tokens": 2048, "batch": 4},
    "mlp": {"model": "mlp", "width": 2048, "depth": 3, "batch": 4},
}

#: What each figure of a bench model in a calibration measures (``compute[k]["models"][name]``:
#: ``k`` bare processes at once; ``collectives[n]["unlimited"]["models"][name]``: the ranks of
#: an ``n``-rank Horovod job). ``step_s`` and ``fwd_bwd_s + adam_s`` are the same work timed
#: two ways and need not agree: the scale model prices a step with collectives by the lock-step
#: phases and `bench train`'s ``local`` method (no collectives) by the free-running step.
FIGURES = {
    "params": "the model's parameter count",
    "step_s": "seconds per whole step (forward, backward, fused Adam) free-running, every "
              "process or rank at its own pace, as `bench train`'s local method runs: what "
              "`bench predict --check` predicts the local row with",
    "fwd_bwd_s": "seconds of forward + backward, every process or rank starting it together "
                 "(lock-step, as collectives line up a step's ranks) until the last is done",
    "adam_s": "seconds of fused Adam's step, in lock-step as fwd_bwd_s: fwd_bwd_s + adam_s is "
              "the compute of every step with collectives, in `bench predict` and its --check "
              "alike; the compressed step replaces adam_s by the 1-bit kernels",
    "fp16_allreduce_s": "seconds of Compression.fp16's cast, allreduce and cast back of the "
                        "model's own gradient (slowest rank; inside the ranks only)",
    "kernel_s_per_elem": "seconds per element of each 1-bit kernel, in lock-step",
}

#: Elements per buffer of the timed kernels: their buffers (64 MiB each) are well beyond a
#: last-level cache, as a model's are. With buffers that partly fit in the cache, processes
#: timed together ran at one process's per-element speed, where ranks streaming a model's
#: buffers share the memory bandwidth.
KERNEL_NUMEL = 16 << 20


def bench_model(cfg: dict, data_seed: int):
    """One of ``bench train``'s models (``cfg`` as in BENCH_MODELS) with fused Adam and one
    batch of data from ``data_seed``, warmed up by three steps. Returns (net, opt, fwd_bwd,
    step): the forward and backward pass, and the whole step."""
    import torch

    from ..train import IN_DIM, OUT_DIM, build_embedding_model, build_mlp

    torch.manual_seed(0)
    net = (build_mlp(cfg["width"], cfg["depth"]) if cfg["model"] == "mlp" else
           build_embedding_model(cfg["vocab"], cfg["embed_dim"], cfg["width"]))
    opt = torch.optim.Adam(net.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(data_seed)
    x = (torch.randn(cfg["batch"], IN_DIM, generator=g) if cfg["model"] == "mlp" else
         torch.randint(cfg["vocab"], (cfg["batch"], cfg["tokens"]), generator=g))
    y = torch.randn(cfg["batch"], OUT_DIM, generator=g)
    loss_fn = torch.nn.MSELoss()

    def fwd_bwd():
        opt.zero_grad()
        loss_fn(net(x), y).backward()

    def step():
        fwd_bwd()
        opt.step()

    for _ in range(3):
        step()
    return net, opt, fwd_bwd, step


def kernel_calls(numel: int) -> dict:
    """The 1-bit kernels as the compressed steps run them, each a call on buffers of ``numel``
    float32 elements (4 chunks), by name; the buffers live as long as the calls."""
    import torch

    from hvd_onebit import kernels
    from hvd_onebit.comm.hierarchical import NodeMean
    from hvd_onebit.kernels import fused_adam
    from hvd_onebit.layout import Layout

    L = Layout.build(numel, 4)
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=g)
    m, y_prev, y_next = (torch.randn(numel, generator=g) * 0.1,
                         torch.randn(L.padded, generator=g) * 0.01, torch.empty(L.padded))
    prev_scales = torch.zeros(L.n * L.nblocks)
    send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8)
    server_z, server_z_out = torch.zeros(L.chunk), torch.empty(L.chunk)
    server_scales, row = torch.zeros(L.nblocks), torch.empty(L.row_bytes, dtype=torch.uint8)
    w, var = torch.randn(numel), torch.rand(numel) + 0.01
    work = torch.empty(numel)
    src = fused_adam.MomentumInput(m, [grad], [numel], 0.9)
    update = fused_adam.AdamUpdate([w], [var], [numel], [-1e-4], [1.0], [0.3], [1e-8])
    x, acc = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    mean = NodeMean([x, acc], torch.empty(numel))
    return {
        "compress_momentum": lambda: fused_adam.worker_compress_momentum(
            src, y_prev, prev_scales, y_next, send, L, "native"),
        # the server reduces one chunk from each of n ranks: L.padded elements read per rank
        "server": lambda: kernels.server_compress(send, server_z, server_scales, server_z_out,
                                                  row, L, "native"),
        "decode_update": lambda: fused_adam.decode_update(send, work, L, update, "native"),
        # the hierarchical collective's passes (hvd_onebit/comm/hierarchical.py): Adam's momentum
        # update written out, the node mean of 2 rows inside the shard's compression (per
        # element of the shard; a float32 add per further row), the plain compress (one node)
        # and decode of a shard, the gathered mean copied out with Adam's update
        "momentum_update": lambda: src.materialize(out=x, backend="native"),
        "compress_mean": lambda: mean.compress(y_prev, prev_scales, y_next, send, L, "native"),
        "update": lambda: update.copy_apply(x, work, "native"),
        "add": lambda: acc.add_(x),
        "compress": lambda: kernels.worker_compress(x, y_prev, prev_scales, y_next, send, L,
                                                    "native"),
        "decode": lambda: kernels.decode(send, work, L, "native"),
    }
