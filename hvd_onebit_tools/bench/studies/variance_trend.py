"""Does Adam's variance settle on this model? Its trend over a run, for choosing the freeze point.

1-bit Adam freezes Adam's variance (``exp_avg_sq``) at ``freeze_step`` and uses it for the rest of
the run. That costs nothing if the variance has stopped moving, and it costs steps if the
gradients keep shrinking: the frozen variance then stays larger than Adam's would be, and every
later step is shorter than Adam's. This script trains an example's model with plain torch Adam in
one process (the global batch of ``--ranks`` ranks; the example's optimizer, betas, learning rate
and schedule) and
prints, every ``--every`` steps, one JSON row:

    step                        the optimizer step
    variance_sum                the bias-corrected variance summed over every parameter
    variance_vs_first           variance_sum / the first row's (how far it has fallen)
    recent_over_variance        the gradients' mean square over the last --every steps (from two
                                snapshots of the raw EMA: (v_t - b2^W v_(t-W)) / (1 - b2^W)),
                                summed, over variance_sum: about 1 once the gradients' scale has
                                settled, well under 1 while it is still falling
    change_10                   freeze_step="auto"'s figure at this step: sum |v_t - v_(t-10)| /
                                sum v_t of the bias-corrected variance (from step 20)

then a summary line with the drop between the first and the last row. ``change_10`` falls as the
running mean takes in more steps whether or not ``recent_over_variance`` is near 1: read both.

Usage:
    python benchmarks/variance_trend.py --example digits            # 1,000 steps, a few seconds
    python benchmarks/variance_trend.py --example lm --steps 1000   # minutes
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def digits_setup(args):
    """(model, optimizer, loss_fn(step) -> loss tensor, lr_fn(step) or None) for train_digits.py."""
    import train_digits

    cfg = train_digits.parse_args(["--seed", str(args.seed)])
    x, y, _, _ = train_digits.load_data(cfg.seed, cfg.val_frac)
    model, optimizer = train_digits.build_model_and_adam(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    batch = cfg.batch_size * args.ranks

    def loss_fn(step: int):
        ix = torch.randint(len(x), (batch,), generator=gen)
        return F.cross_entropy(model(x[ix]), y[ix])

    return model, optimizer, loss_fn, None


def lm_setup(args):
    """The same for train_lm.py: its model, AdamW, weight decay and learning-rate schedule."""
    import train_lm

    cfg = train_lm.parse_args(["--steps", str(args.steps), "--seed", str(args.seed)])
    data = train_lm.load_text()
    train = data[:-int(len(data) * cfg.val_frac)]
    model, optimizer = train_lm.build_model_and_adamw(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    batch = cfg.batch_size * args.ranks

    def loss_fn(step: int):
        return model(*train_lm.get_batch(train, batch, cfg.context, gen))[1]

    return model, optimizer, loss_fn, lambda step: train_lm.lr_at(step, cfg)


def raw_variance(optimizer) -> torch.Tensor:
    return torch.cat([s["exp_avg_sq"].flatten() for s in optimizer.state.values()])


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--example", choices=["digits", "lm"], default="digits")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=50, help="steps between rows (at least 10)")
    p.add_argument("--ranks", type=int, default=4, help="global batch = the example's per-rank "
                                                         "batch x this")
    p.add_argument("--seed", type=int, default=None, help="default: the example's")
    args = p.parse_args(argv)
    if args.every < 10:
        p.error("--every must be at least 10 (change_10 needs the variance 10 steps back)")
    if args.seed is None:
        from hvd_onebit_tools.bench.studies.auto_freeze import EXAMPLE_SEEDS

        args.seed = EXAMPLE_SEEDS[args.example]
    sys.path.insert(0, str(EXAMPLES))
    torch.set_num_threads(1)
    model, optimizer, loss_fn, lr_fn = (digits_setup if args.example == "digits"
                                        else lm_setup)(args)
    beta2 = optimizer.param_groups[0]["betas"][1]
    rows, snap = [], {0: torch.zeros_like(torch.cat([q.detach().flatten()
                                                      for q in model.parameters()]))}
    for step in range(1, args.steps + 1):
        if lr_fn is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_fn(step - 1)
        loss = loss_fn(step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.every in (0, args.every - 10):
            snap[step] = raw_variance(optimizer).clone()
        if step % args.every == 0:
            v = snap[step] / (1 - beta2 ** step)
            row = {"step": step, "variance_sum": float(v.sum())}
            if step > 10:
                back10 = snap[step - 10] / (1 - beta2 ** (step - 10))
                row["change_10"] = float((v - back10).abs().sum() / v.sum())
            if step > args.every:  # the first row's window is the whole run: 1 by construction
                decay = beta2 ** args.every
                recent = (snap[step] - decay * snap[step - args.every]) / (1 - decay)
                row["recent_over_variance"] = float(recent.sum() / v.sum())
            row["variance_vs_first"] = row["variance_sum"] / (rows[0]["variance_sum"] if rows
                                                              else row["variance_sum"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            snap = {k: t for k, t in snap.items() if k >= step - args.every}
    summary = {"example": args.example, "steps": args.steps, "global_batch_ranks": args.ranks,
               "seed": args.seed,
               "variance_drop_first_to_last": rows[0]["variance_sum"] / rows[-1]["variance_sum"]}
    print(json.dumps(summary), flush=True)
    return rows


if __name__ == "__main__":
    main()
