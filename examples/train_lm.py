"""Train a small GPT-style byte-level language model with Horovod or DDP, using Adam or 1-bit Adam.

The text is the Python reference documentation that ships with every CPython
(``pydoc_data.topics``, about 465 KB of English): nothing is downloaded. The last 10% is held out
for validation.

Run it on 4 local ranks:

    horovodrun -np 4 -H localhost:4 --gloo python examples/train_lm.py --optimizer onebit

``--optimizer`` changes exactly one thing, the line that wraps the optimizer:

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    optimizer = hvd_onebit.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                freeze_step=freeze_step)

Everything else (seeds, model initialisation, the data each rank sees at each step, the LR
schedule, evaluation) is the same for both, so the two runs can be compared step by step.

``--face ddp`` runs the same training as a plain DDP script under torchrun, importing no Horovod:

    python -m torch.distributed.run --standalone --nproc_per_node=4 examples/train_lm.py \
        --face ddp --optimizer onebit

The face changes how the ranks start and talk (``dist.init_process_group`` and
``dist.all_reduce`` instead of ``hvd.init`` and ``hvd.allreduce``) and the wrapping lines:

    model = DDP(model)                      # broadcasts rank 0's parameters
    optimizer = hvd_onebit.ddp.DistributedOptimizer(optimizer, model, freeze_step=freeze_step)

(``--optimizer adam`` keeps DDP + the AdamW alone). The data, the model, the schedule and the
1-bit defaults are the Horovod face's.

``--warmup-frac auto`` passes ``freeze_step="auto"`` instead: the variance is frozen once it has
settled (bounded by half the steps); the summary's ``freeze_step`` and ``freeze_decision`` say
where and why.

Learning rate: linear warmup over the first ``--lr-warmup-frac`` of the steps (default 2%), then
cosine decay to 10% of ``--lr``. With 1-bit Adam the LR warmup should end well before
``freeze_step`` (default: 5% of the steps with the default refresh, 20% with
``--variance-refresh none``), so Adam's variance is frozen only after it has seen
gradients at full learning rate.

Data: the training text is split into one contiguous shard per rank; each rank draws random
windows from its own shard with a generator seeded from ``--seed`` and its rank, so the data order
depends on the seed and the world size, never on the optimizer. Validation uses a fixed set of
non-overlapping windows of the held-out text, split among the ranks and averaged with an
allreduce, so the validation loss does not depend on the world size either.

Waiting: ``hvd.synchronize`` spins on ``sched_yield`` until an allreduce is done; when ranks share
cores, the spinning ranks take CPU from those still computing. hvd_onebit's waits sleep. ``--wait
sleep`` (default) gives Horovod's optimizer the same sleeping wait, so that Adam and 1-bit Adam
wait alike and a comparison measures compression; ``--wait spin`` keeps Horovod's own wait (what
plain Horovod does). It changes the time only, never the numbers; 1-bit Adam sleeps either way.

Checkpoints: ``--checkpoint-every N`` saves ``step<N>.pt`` files into ``--checkpoint-dir`` (rank
0 writes; with 1-bit Adam every rank first folds its error feedback into the momentum, so the
file alone resumes, on any number of ranks); ``--resume PATH`` goes on from one with the same
``--steps``, drawing the same batches as the run that wrote it. The Horovod face takes Horovod's
recipe (rank 0 loads, then ``hvd.broadcast_optimizer_state`` and ``hvd.broadcast_parameters``),
the DDP face DDP's (every rank loads the file).

``--out PATH`` writes a summary (rank 0): the validation-loss curve, train loss, samples/s,
bytes sent and seconds blocked on communication per step for each phase, the final validation
loss, the world size and the config. Its ``phases`` are ``warmup``, ``compression`` (the
compressed steps only) and ``refresh`` (the variance refresh steps: full precision inside the
compression phase), or ``full_precision`` for Adam.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_onebit
import hvd_onebit.ddp
from hvd_onebit.config import DOUBLING, FREEZE_FRACTION, FROZEN_FREEZE_FRACTION, AutoFreeze
from hvd_onebit_tools.bench.refresh import (option_text, optimizer_options,
                                             parse_variance_refresh, run_steps)
from hvd_onebit_tools.bench.waits import WAITS, WaitTimer, set_horovod_wait


# ---------------------------------------------------------------------------------------------
# Model: pre-LN transformer decoder over bytes, tied input/output embeddings.
# ---------------------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=256, context=64, d_model=128, n_layer=2, n_head=4):
        super().__init__()
        self.context = context
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------
# Data: the Python docs as bytes.
# ---------------------------------------------------------------------------------------------

def load_text() -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def get_batch(shard: torch.Tensor, batch_size: int, context: int, gen: torch.Generator):
    ix = torch.randint(len(shard) - context - 1, (batch_size,), generator=gen)
    x = torch.stack([shard[i:i + context] for i in ix.tolist()])
    y = torch.stack([shard[i + 1:i + 1 + context] for i in ix.tolist()])
    return x, y


class Ranks:
    """This rank, the world size and sums over the ranks, through Horovod or torch.distributed
    (``--face``): the one place the two faces' collectives differ."""

    def __init__(self, face: str):
        self.hvd, self.owns_group = None, False
        if face == "ddp":
            if not dist.is_initialized():  # (a caller's group, when main() runs inside a job)
                if "RANK" not in os.environ:
                    raise SystemExit("--face ddp runs under torchrun, which starts its ranks: "
                                     "torchrun --nproc_per_node=2 examples/train_lm.py --face "
                                     "ddp ...")
                dist.init_process_group("gloo")  # torchrun sets the rank, world size, address
                self.owns_group = True
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        else:
            import horovod.torch as hvd

            hvd.init()
            self.hvd, self.rank, self.size = hvd, hvd.rank(), hvd.size()

    def sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if self.hvd is None:
            dist.all_reduce(tensor)
            return tensor
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name)


@torch.no_grad()
def evaluate(model, val_windows: torch.Tensor, batch_size: int, ranks: Ranks) -> float:
    """Mean loss over the fixed validation windows; each rank takes every world-th window."""
    model.eval()
    mine = val_windows[ranks.rank::ranks.size]
    total = torch.zeros(2, dtype=torch.float64)  # [sum of per-token losses, tokens]
    for i in range(0, len(mine), batch_size):
        chunk = mine[i:i + batch_size]
        _, loss = model(chunk[:, :-1], chunk[:, 1:])
        n = chunk[:, 1:].numel()
        total += torch.tensor([loss.item() * n, n], dtype=torch.float64)
    model.train()
    total = ranks.sum(total, "eval_loss")
    return float(total[0] / total[1])


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    warmup = max(1, round(args.lr_warmup_frac * args.steps))
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def ring_allreduce_bytes(model: nn.Module, world: int) -> int:
    """Bytes one rank sends per step in Horovod's ring allreduce of fp32 gradients (estimate)."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return int(2 * (world - 1) / world * numel * 4) if world > 1 else 0


def number_in(kind, what: str, ok):
    """An argparse type: a finite ``kind`` (int or float) for which ``ok(value)`` holds, or an
    argument error saying it must be ``what``."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return convert


positive_int = number_in(int, "a positive integer", lambda v: v >= 1)  # steps, sizes, intervals
non_negative_int = number_in(int, "an integer >= 0", lambda v: v >= 0)  # 0: said in its help
positive_float = number_in(float, "a positive number", lambda v: v > 0)
non_negative_float = number_in(float, "a number >= 0", lambda v: v >= 0)
fraction_of_steps = number_in(float, "a fraction of --steps from 0 to 1", lambda v: 0 <= v <= 1)
# --val-frac: both the training part and the held-out part are needed
held_out_fraction = number_in(float, "a fraction strictly between 0 and 1 (the share of the data "
                              "held out)", lambda v: 0 < v < 1)
# --block-size: elements per scale, as hvd_onebit requires
block_size = number_in(int, "a positive multiple of 8", lambda v: v >= 1 and v % 8 == 0)


def warmup_frac(text: str):
    """--warmup-frac: a fraction of the steps from 0 to 1, or "auto"."""
    if text == "auto":
        return text
    try:
        return fraction_of_steps(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be 'auto' or a fraction of --steps from 0 to 1, got {text}") from None


def variance_refresh(text: str):
    """--variance-refresh: none, doubling or a JSON object of the schedule's fields."""
    try:
        return parse_variance_refresh(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


AUTO_MIN_STEPS = AutoFreeze().min_steps


def freeze_options(frac, steps: int, min_steps=None) -> dict:
    """hvd_onebit.DistributedOptimizer's freeze arguments for --warmup-frac (and, with "auto",
    --auto-freeze-min-steps)."""
    if frac == "auto":
        half = max(1, steps // 2)
        auto = ({"min_steps": min(AUTO_MIN_STEPS, half), "max_steps": half} if min_steps is None
                else {"min_steps": min_steps, "max_steps": max(half, min_steps)})
        return {"freeze_step": "auto", "auto_freeze": auto}
    return {"freeze_step": max(1, round(frac * steps))}


def onebit_options(args, **knobs) -> dict:
    """The freeze arguments, variance_refresh and block_size. --warmup-frac defaults to the recommended
    freeze for the refresh setting (hvd_onebit.config). The automatic freeze's settings, a
    schedule given as a dict and ``knobs`` (e.g. ``compressor``) go into one
    ``experimental=Experimental(...)``."""
    if args.warmup_frac is None:
        args.warmup_frac = (FROZEN_FREEZE_FRACTION if args.variance_refresh is None
                            else FREEZE_FRACTION)
    options = freeze_options(args.warmup_frac, args.steps, args.auto_freeze_min_steps)
    if args.block_size is not None:
        options["block_size"] = args.block_size
    return optimizer_options(args.variance_refresh, **options, **knobs)


def refresh_summary(args, optimizer) -> dict:
    """The summary's variance_refresh and the run's steps by kind (warmup, refreshes,
    compressed), counted from the schedule and where the variance froze."""
    out = {"variance_refresh": option_text(args.variance_refresh
                                           if args.optimizer == "onebit" else None)}
    freeze = optimizer.freeze_step if args.optimizer == "onebit" else None
    if isinstance(freeze, int):
        out["steps_by_kind"] = run_steps(args.steps, freeze, args.variance_refresh)
    return out


def add_onebit_arguments(p: argparse.ArgumentParser) -> None:
    """The 1-bit options both examples take: --variance-refresh, --auto-freeze-min-steps,
    --block-size."""
    p.add_argument("--variance-refresh", type=variance_refresh, default=DOUBLING,
                   help="1-bit Adam's variance_refresh: doubling (0/1 Adam's schedule, the "
                        "default), none or a JSON object of its fields, e.g. "
                        "'{\"first_interval\": 16, \"updates_per_interval\": 4}'")
    p.add_argument("--auto-freeze-min-steps", type=positive_int, default=None,
                   help="with --warmup-frac auto: auto_freeze's min_steps (default: its own, "
                        f"{AUTO_MIN_STEPS}, or half the steps where that is fewer)")
    p.add_argument("--block-size", type=block_size, default=None,
                   help="1-bit Adam: elements per scale (a multiple of 8) [default: the "
                        f"optimizer's block_size, {hvd_onebit.config.DEFAULT_BLOCK_SIZE}]")


WARMUP_FRAC_HELP = (f"1-bit Adam: freeze_step = round(warmup_frac * steps), at least 1 (so 0 "
                    f"freezes after one step) and below --steps (so some step is compressed), "
                    f"or 'auto': freeze once Adam's variance has settled (at most after half the "
                    f"steps) [default: {FREEZE_FRACTION}, {FROZEN_FREEZE_FRACTION} with "
                    f"--variance-refresh none]")


def check_freeze(p: argparse.ArgumentParser, args) -> None:
    """With --optimizer onebit, refuse a freeze that leaves no compressed step (the run would
    be Adam's, with nothing said)."""
    if args.optimizer != "onebit":
        return
    if args.warmup_frac == "auto":
        latest = freeze_options("auto", args.steps,
                                args.auto_freeze_min_steps)["auto_freeze"]["max_steps"]
        if latest >= args.steps:
            p.error(f"argument --warmup-frac: auto over --steps {args.steps} may freeze at step "
                    f"{latest}, leaving no compressed step; give more --steps (or a smaller "
                    f"--auto-freeze-min-steps)")
        return
    given = args.warmup_frac is not None
    frac = args.warmup_frac if given else (FROZEN_FREEZE_FRACTION if args.variance_refresh is None
                                           else FREEZE_FRACTION)
    freeze = freeze_options(frac, args.steps)["freeze_step"]
    if freeze < args.steps:
        return
    if given:
        p.error(f"argument --warmup-frac: {frac} x --steps {args.steps} freezes at step {freeze}, "
                f"leaving no compressed step; give a smaller --warmup-frac or more --steps")
    p.error(f"argument --steps: {args.steps} step(s) with the default --warmup-frac {frac} "
            f"freeze at step {freeze}, leaving no compressed step; give more --steps (or "
            f"--optimizer adam)")


def build_model_and_adamw(args):
    """The model from ``args.seed`` and its local optimizer: AdamW, weight decay on the
    matrices only."""
    torch.manual_seed(args.seed)
    model = GPT(context=args.context, d_model=args.d_model, n_layer=args.n_layer,
                n_head=args.n_head)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.99))
    return model, optimizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=["adam", "onebit"], default="onebit")
    p.add_argument("--face", choices=["horovod", "ddp"], default="horovod",
                   help="horovod: under horovodrun, hvd.DistributedOptimizer or "
                        "hvd_onebit.DistributedOptimizer; ddp: under torchrun, DDP + AdamW or "
                        "hvd_onebit.ddp.DistributedOptimizer, importing no Horovod")
    p.add_argument("--steps", type=positive_int, default=1000)
    p.add_argument("--batch-size", type=positive_int, default=16,
                   help="sequences per rank per step")
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument("--lr-warmup-frac", type=fraction_of_steps, default=0.02,
                   help="linear LR warmup, as a fraction of --steps (keep it << --warmup-frac)")
    p.add_argument("--warmup-frac", type=warmup_frac, default=None, help=WARMUP_FRAC_HELP)
    p.add_argument("--weight-decay", type=non_negative_float, default=0.1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data-seed", type=int, default=None,
                   help="seeds only the order of the batches each rank draws (default: --seed); "
                        "a run that differs from another only here shows how much the final "
                        "loss moves with the batch order alone")
    p.add_argument("--eval-every", type=positive_int, default=50)
    p.add_argument("--eval-batches", type=non_negative_int, default=8,
                   help="validation windows = eval_batches * batch_size (0: the whole split)")
    p.add_argument("--val-frac", type=held_out_fraction, default=0.1,
                   help="the share of the text held out for validation (its end)")
    p.add_argument("--context", type=positive_int, default=64)
    p.add_argument("--d-model", type=positive_int, default=128)
    p.add_argument("--n-layer", type=positive_int, default=2)
    p.add_argument("--n-head", type=positive_int, default=4, help="divides --d-model")
    p.add_argument("--threads", type=positive_int,
                   default=int(os.environ.get("OMP_NUM_THREADS", "1")),
                   help="torch intra-op threads per rank")
    p.add_argument("--onebit-hierarchical", action="store_true",
                   help="1-bit Adam: hierarchical=True (full precision inside each node, 1-bit "
                        "between nodes)")
    p.add_argument("--wait", choices=WAITS, default="sleep",
                   help="how Horovod's optimizer waits for its allreduces: sleep (as hvd_onebit "
                        "does) or spin (Horovod's own sched_yield loop); time only")
    add_onebit_arguments(p)
    p.add_argument("--out", "--json-out", dest="out", default=None,
                   help="write a JSON summary here (rank 0); --json-out is an alias")
    p.add_argument("--checkpoint-every", type=positive_int, default=None,
                   help="save a checkpoint every N steps into --checkpoint-dir (rank 0)")
    p.add_argument("--checkpoint-dir", default="checkpoints",
                   help="where --checkpoint-every writes step<N>.pt [default: checkpoints]")
    p.add_argument("--resume", default=None, metavar="PATH",
                   help="go on from a checkpoint of a run with the same --steps")
    return p


def parse_args(argv=None):
    """The options, each checked alone by its type and together here, so a bad value stops
    every rank with the same argument error before any rank starts talking to the others."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.d_model % args.n_head:
        p.error(f"argument --n-head: {args.n_head} does not divide --d-model {args.d_model}; "
                f"give a --n-head that divides it")
    check_freeze(p, args)
    if args.checkpoint_every and args.checkpoint_every > args.steps:
        p.error(f"argument --checkpoint-every: {args.checkpoint_every} is past the run's "
                f"--steps {args.steps}: no checkpoint would be written")
    if args.checkpoint_every and os.path.exists(args.checkpoint_dir) \
            and not os.path.isdir(args.checkpoint_dir):
        p.error(f"argument --checkpoint-dir: {args.checkpoint_dir} is a file, not a folder")
    return args


def split_text(data: torch.Tensor, val_frac: float, context: int, world: int):
    """(train, val): the last ``val_frac`` of the bytes held out, the rest for training. Raises
    ValueError when the held-out part has no validation window (``context + 1`` bytes) or a
    rank's training shard (the training part over ``world`` ranks) cannot give one training
    window and its target (``context + 2`` bytes)."""
    n_val = int(len(data) * val_frac)
    train, val = data[:len(data) - n_val], data[len(data) - n_val:]
    if len(val) < context + 1:
        raise ValueError(f"--val-frac {val_frac} holds out {len(val)} of the text's {len(data)} "
                         f"bytes, fewer than one validation window of --context {context} needs "
                         f"({context + 1}); raise --val-frac or lower --context")
    shard = len(train) // world
    if shard < context + 2:
        ranks = f", {shard} per rank on {world} ranks," if world > 1 else ""
        raise ValueError(f"--val-frac {val_frac} leaves {len(train)} of the text's {len(data)} "
                         f"bytes for training{ranks} fewer than one training window of --context "
                         f"{context} needs ({context + 2}); lower --val-frac or --context"
                         f"{', or use fewer ranks' if world > 1 else ''}")
    return train, val


def save_checkpoint(args, step: int, model, optimizer, rank: int) -> None:
    """Every rank calls it: 1-bit Adam folds each rank's error feedback into the momentum first
    (one allreduce), so rank 0's file holds all the training state."""
    if args.optimizer == "onebit":
        optimizer.flush_error_feedback()
    if rank == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        path = os.path.join(args.checkpoint_dir, f"step{step}.pt")
        torch.save({"step": step, "steps": args.steps, "model": model.state_dict(),
                    "optimizer": optimizer.state_dict()}, path + ".tmp")
        os.replace(path + ".tmp", path)  # a crash while saving leaves the last file whole


def load_checkpoint(args, model, optimizer, ranks) -> int:
    """``args.resume`` into the model and the optimizer; returns its step. Horovod: rank 0 reads
    the file and sends it (a failure is raised on every rank); DDP: every rank reads it."""
    def read() -> dict:
        ckpt = torch.load(args.resume, map_location="cpu", weights_only=True)
        if ckpt["steps"] != args.steps:
            raise ValueError(f"--resume {args.resume} is from a run of --steps {ckpt['steps']}, "
                             f"this one has --steps {args.steps} (the LR schedule spans them)")
        model.load_state_dict(ckpt["model"])
        state = ckpt["optimizer"]
        if args.optimizer == "adam" and "onebit" in state:  # a 1-bit run's, taken on by Adam
            state = hvd_onebit.torch_adam_state_dict(state)
        optimizer.load_state_dict(state)
        return ckpt["step"]

    def attempt():
        try:
            return read()
        except (pickle.UnpicklingError, EOFError) as exc:  # not a file torch.save wrote whole
            return (f"cannot resume from {args.resume}: not a checkpoint this script wrote "
                    f"whole (torch.load raised {type(exc).__name__})")
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            return f"cannot resume from {args.resume}: {exc}"

    if ranks.hvd is None:  # every rank reads the same file, so every rank fails alike
        outcome = attempt()
        if isinstance(outcome, str):
            raise SystemExit(outcome)
        return outcome
    hvd = ranks.hvd
    outcome = hvd.broadcast_object(attempt() if ranks.rank == 0 else None, root_rank=0,
                                   name="resume")
    if isinstance(outcome, str):
        raise SystemExit(outcome)
    # the optimizer state first: on a fresh torch optimizer Horovod's broadcast takes a step
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return outcome


def main(argv=None):
    args = parse_args(argv)
    data = load_text()
    try:  # before any rank starts: a split no world size could train on
        split_text(data, args.val_frac, args.context, 1)
    except ValueError as exc:
        build_parser().error(str(exc))
    ranks = Ranks(args.face)
    torch.set_num_threads(args.threads)
    horovod_waits = WaitTimer()  # seconds hvd.DistributedOptimizer blocks on its allreduces
    if args.face == "horovod":
        set_horovod_wait(args.wait, horovod_waits)
    rank, world = ranks.rank, ranks.size
    log = print if rank == 0 else (lambda *a, **k: None)

    # Data: train = first (1 - val_frac) of the bytes, one contiguous shard per rank.
    try:  # every rank splits alike, so every rank stops alike
        train_data, val_data = split_text(data, args.val_frac, args.context, world)
    except ValueError as exc:
        build_parser().error(str(exc))
    shard_len = len(train_data) // world
    shard = train_data[rank * shard_len:(rank + 1) * shard_len]
    data_seed = args.seed if args.data_seed is None else args.data_seed
    gen = torch.Generator().manual_seed(data_seed * 1000 + rank)
    window = args.context + 1
    val_windows = val_data[:len(val_data) // window * window].view(-1, window)
    if args.eval_batches > 0 and len(val_windows) > args.eval_batches * args.batch_size:
        keep = torch.linspace(0, len(val_windows) - 1, args.eval_batches * args.batch_size)
        val_windows = val_windows[keep.round().long()]

    model, optimizer = build_model_and_adamw(args)
    n_params = sum(p.numel() for p in model.parameters())

    freeze = onebit_options(args)
    trained = model  # what the training steps call: the model, or its DDP module
    if args.face == "ddp":
        # ---- the DDP face's lines: DDP broadcasts rank 0's parameters ------------------------
        trained = DDP(model)
        if args.optimizer == "onebit":
            optimizer = hvd_onebit.ddp.DistributedOptimizer(
                optimizer, trained, hierarchical=args.onebit_hierarchical, **freeze)
    else:
        hvd = ranks.hvd
        # ---- the one line that differs ------------------------------------------------------
        if args.optimizer == "adam":
            optimizer = hvd.DistributedOptimizer(optimizer,
                                                 named_parameters=model.named_parameters())
        else:
            optimizer = hvd_onebit.DistributedOptimizer(
                optimizer, named_parameters=model.named_parameters(),
                hierarchical=args.onebit_hierarchical, **freeze)
        # -------------------------------------------------------------------------------------
        # Same start on every rank: rank 0's parameters. A fresh optimizer's state is zeros on
        # every rank, so it needs no broadcast; call hvd.broadcast_optimizer_state(optimizer, 0)
        # when resuming from a checkpoint. (On a fresh torch optimizer Horovod's broadcast
        # creates the state by taking one step with zero gradients, which would start plain Adam
        # one step ahead and apply AdamW's decay once; hvd_onebit's optimizer takes no such step.)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    start = load_checkpoint(args, model, optimizer, ranks) if args.resume else 0
    for _ in range(start):  # the batches the run that wrote it drew: the same data from here
        get_batch(shard, args.batch_size, args.context, gen)

    frozen_at = "-"  # the optimizer's own, after a resume: a checkpoint may have set it
    if args.optimizer == "onebit":
        frozen_at = optimizer.freeze_step or freeze["freeze_step"]  # None: "auto", undecided
    log(f"world={world} params={n_params / 1e6:.2f}M face={args.face} optimizer={args.optimizer} "
        f"freeze_step={frozen_at} "
        f"train={len(train_data)}B val={len(val_data)}B eval_windows={len(val_windows)}"
        + (f" resumed at step {start}" if args.resume else ""))

    def phase_now():
        return optimizer.phase if args.optimizer == "onebit" else "full_precision"

    phases: dict[str, dict] = {}
    curve, train_curve, phase_switch_step = [], [], None
    recent_losses: list[float] = []
    train_losses: list[float] = []  # this rank's loss at every step
    adam_bytes = ring_allreduce_bytes(model, world)
    t_start = time.perf_counter()

    def record_eval(step):
        val = evaluate(model, val_windows, args.batch_size, ranks)
        tr = None
        if recent_losses:
            mean = torch.tensor(sum(recent_losses) / len(recent_losses))
            tr = float(ranks.sum(mean, "train_loss")) / world
            recent_losses.clear()
        curve.append({"step": step, "val_loss": val, "phase": phase_now(), "lr": lr_at(step, args),
                      "elapsed_s": time.perf_counter() - t_start})
        if tr is not None:
            train_curve.append({"step": step, "train_loss": tr})
        log(f"step {step:5d} | val {val:.4f} | train {tr if tr is None else round(tr, 4)} "
            f"| phase {phase_now()} | {time.perf_counter() - t_start:.0f}s")

    record_eval(start)
    for step in range(start, args.steps):
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        phase = phase_now()
        if phase == "compression" and phase_switch_step is None:
            phase_switch_step = step
        refreshes = optimizer.telemetry()["refreshes"] if args.optimizer == "onebit" else 0
        t0, c0 = time.perf_counter(), time.process_time()
        x, y = get_batch(shard, args.batch_size, args.context, gen)
        _, loss = trained(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        waited = horovod_waits.take()
        if args.optimizer == "onebit":
            telemetry = optimizer.telemetry()
            sent, waited = telemetry["last_step_bytes"], telemetry["last_step_comm_seconds"]
            if telemetry["refreshes"] > refreshes:  # full precision inside the compression phase
                phase = "refresh"
        else:
            sent = adam_bytes
        ph = phases.setdefault(phase, {"steps": 0, "seconds": 0.0, "bytes": 0, "comm_seconds": 0.0,
                                       "cpu_seconds": 0.0, "first_step": step})
        ph["steps"] += 1
        ph["seconds"] += dt
        ph["bytes"] += sent
        ph["comm_seconds"] += waited
        ph["cpu_seconds"] += cpu
        recent_losses.append(loss.item())
        train_losses.append(recent_losses[-1])
        if not math.isfinite(recent_losses[-1]):
            raise FloatingPointError(f"non-finite training loss at step {step}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            record_eval(step + 1)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(args, step + 1, model, optimizer, rank)

    wall = time.perf_counter() - t_start
    for name, ph in phases.items():
        ph["samples_per_sec"] = ph["steps"] * args.batch_size * world / max(ph["seconds"], 1e-9)
        ph["bytes_per_step"] = ph["bytes"] / ph["steps"]
        ph["seconds_per_step"] = ph["seconds"] / ph["steps"]
        ph["comm_seconds_per_step"] = ph["comm_seconds"] / ph["steps"]
        ph["comm_share"] = ph["comm_seconds"] / max(ph["seconds"], 1e-9)
        ph["cpu_seconds_per_step"] = ph["cpu_seconds"] / ph["steps"]
    summary = {
        "optimizer": args.optimizer,
        "face": args.face,
        "world_size": world,
        "params": n_params,
        "freeze_step": optimizer.freeze_step if args.optimizer == "onebit" else None,
        "freeze_decision": optimizer.freeze_decision if args.optimizer == "onebit" else None,
        "phase_switch_step": phase_switch_step,
        "final_val_loss": curve[-1]["val_loss"],
        "val_curve": curve,
        "train_curve": train_curve,
        "train_loss_per_step_rank0": train_losses,
        "phases": phases,
        "total_bytes_per_rank": sum(ph["bytes"] for ph in phases.values()),
        "bytes_note": ("onebit: opt.telemetry() (warmup and refresh: ring-allreduce estimate; "
                       "compression: bytes on the wire)" if args.optimizer == "onebit" else
                       "adam: ring-allreduce estimate, 2*(n-1)/n * 4 bytes per parameter"),
        "telemetry": optimizer.telemetry() if args.optimizer == "onebit" else None,
        "wait": args.wait,
        **refresh_summary(args, optimizer),
        "comm_note": ("comm_seconds: rank 0's seconds blocked on communication in each step ("
                      "onebit: opt.telemetry()['last_step_comm_seconds']; adam: inside Horovod's "
                      "per-handle synchronize, none counted under DDP, whose reducer waits inside "
                      "backward); cpu_seconds: rank 0's process CPU time in its steps (all "
                      "threads): a spinning wait burns CPU that ranks sharing a core need"),
        "train_seconds": sum(ph["seconds"] for ph in phases.values()),
        "resumed_at_step": start,
        "samples_per_sec": (args.steps - start) * args.batch_size * world
        / max(sum(ph["seconds"] for ph in phases.values()), 1e-9),
        "wall_seconds": wall,
        "config": vars(args),
    }
    if rank == 0:
        log(f"done: final val loss {summary['final_val_loss']:.4f}, "
            f"{summary['samples_per_sec']:.0f} samples/s, {wall:.0f}s, "
            f"{summary['total_bytes_per_rank'] / 2**20:.1f} MiB sent per rank")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)
    if ranks.owns_group:
        # The DDP model first: its reducer holds the process group, whose Gloo threads, left
        # running to the interpreter's exit, can abort the process there.
        del trained, optimizer
        gc.collect()
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
