"""The zoo's data sets, each made here from a seed: nothing is downloaded.

Every maker returns a :class:`Split` of tensors (inputs, targets) for training and for held-out
evaluation. The same seed gives the same tensors on every rank and in every run, so Adam and
1-bit Adam train on exactly the same examples. The only outside data is scikit-learn's bundled
8x8 digits (shipped inside the package, as ``examples/train_digits.py`` uses it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Split:
    """Training and held-out tensors: ``x[i]`` is one example, ``y[i]`` its target."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_held: torch.Tensor
    y_held: torch.Tensor


def _gen(seed: int, salt: int) -> torch.Generator:
    # One generator per purpose, so that changing how much one maker draws never shifts another.
    return torch.Generator().manual_seed(seed * 7919 + salt)


def mnist_like_digits(seed: int, n_train: int = 4096, n_held: int = 512,
                      style: str = "noisy") -> Split:
    """MNIST-shaped digits: scikit-learn's 8x8 digits upsampled to 20x20 inside a 28x28 canvas
    (as MNIST centres a 20x20 digit), normalised with MNIST's mean and std as Horovod's
    pytorch_mnist.py does. ``style``:

    * "noisy" (default): shifted by up to 3 pixels, random contrast, Gaussian noise (0.15) on
      every pixel, background included;
    * "clean": as MNIST, a black background (exact zeros before normalisation, so units that see
      only background get no gradient, and ReLU units die or fire intermittently), shifted by
      up to 2 pixels, with random contrast and stroke texture. The zoo's mnist_cnn uses it: it
      is the style on which the unbounded frozen-variance step diverges.

    The held-out examples are drawn from digit images no training example comes from (the 1,797
    source images are split 80/20 by the seed), so the held-out loss measures generalisation.
    """
    from sklearn.datasets import load_digits

    if style not in ("noisy", "clean"):
        raise ValueError(f"style must be 'noisy' or 'clean', got {style!r}")
    digits = load_digits()
    base = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    g = _gen(seed, 1)
    perm = torch.randperm(len(base), generator=g)
    n_base_held = len(base) // 5
    pools = (perm[n_base_held:], perm[:n_base_held])
    max_shift = 3 if style == "noisy" else 2

    def make(pool: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pick = pool[torch.randint(len(pool), (n,), generator=g)]
        small = F.interpolate(base[pick], size=(20, 20), mode="bilinear", align_corners=False)
        if style == "clean":
            texture = 0.7 + 0.3 * torch.rand(small.shape, generator=g)
            small = small * texture * (0.6 + 0.4 * torch.rand(n, 1, 1, 1, generator=g))
        shifts = torch.randint(-max_shift, max_shift + 1, (n, 2), generator=g)
        canvas = _shifted(F.pad(small, (4, 4, 4, 4)), shifts)
        if style == "noisy":  # (the draws in this order: the first version's exact bits)
            contrast = 0.6 + 0.4 * torch.rand(n, 1, 1, 1, generator=g)
            canvas = (canvas * contrast + 0.15 * torch.randn(canvas.shape, generator=g)).clamp(0, 1)
        return (canvas - 0.1307) / 0.3081, labels[pick]

    x_train, y_train = make(pools[0], n_train)
    x_held, y_held = make(pools[1], n_held)
    return Split(x_train, y_train, x_held, y_held)


def _shifted(centred: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Each image ``centred[i]`` ([n, 1, H, W], content inside a zero border wider than any
    shift) moved by ``shifts[i] = (dy, dx)`` pixels, in one gather: the rows and columns that
    wrap around come from the zero border."""
    n, _, h, w = centred.shape
    rows = (torch.arange(h)[None] - shifts[:, :1]) % h                     # [n, H]
    cols = (torch.arange(w)[None] - shifts[:, 1:]) % w                     # [n, W]
    return centred[torch.arange(n)[:, None, None], 0, rows[:, :, None], cols[:, None, :]] \
        .unsqueeze(1)


def grating_images(seed: int, size: int = 16, classes: int = 8, n_train: int = 4096,
                   n_held: int = 512, label_noise: float = 0.05) -> Split:
    """3-channel ``size`` x ``size`` images of noisy sinusoidal gratings; the class is the
    grating's orientation (``classes`` angles over 180 degrees). Frequency, phase, colour, a
    bright blob and pixel noise are nuisances drawn per image, and ``label_noise`` of the labels
    are replaced at random, so the best held-out loss stays well above zero and the ratios to
    Adam's loss are not ratios of tiny numbers."""
    g = _gen(seed, 2)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(classes, (n,), generator=g)
        theta = (y.float() + 0.3 * (torch.rand(n, generator=g) - 0.5)) * torch.pi / classes
        freq = 0.5 + 0.6 * torch.rand(n, generator=g)
        phase = 2 * torch.pi * torch.rand(n, generator=g)
        coords = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
        yy, xx = torch.meshgrid(coords, coords, indexing="ij")
        proj = (xx[None] * torch.cos(theta)[:, None, None]
                + yy[None] * torch.sin(theta)[:, None, None])
        wave = torch.sin(freq[:, None, None] * proj + phase[:, None, None])      # [n, H, W]
        colour = torch.rand(n, 3, 1, 1, generator=g) * 2 - 1
        centre = (torch.rand(n, 2, generator=g) - 0.5) * size
        blob = torch.exp(-((xx[None] - centre[:, 0, None, None]) ** 2
                           + (yy[None] - centre[:, 1, None, None]) ** 2) / 8.0)
        x = wave[:, None] * colour + blob[:, None] + 0.6 * torch.randn(n, 3, size, size,
                                                                        generator=g)
        flip = torch.rand(n, generator=g) < label_noise
        y = torch.where(flip, torch.randint(classes, (n,), generator=g), y)
        return x, y

    x_train, y_train = make(n_train)
    x_held, y_held = make(n_held)
    return Split(x_train, y_train, x_held, y_held)


def markov_text(seed: int, vocab: int = 32, n_train: int = 200_000, n_held: int = 20_000,
                branching: int = 4) -> Split:
    """Character-level text from a random second-order Markov chain over ``vocab`` symbols.

    Each pair of previous symbols allows ``branching`` next symbols with Dirichlet-drawn
    probabilities, so the text has structure an LM can learn (entropy well below log(vocab))
    and a floor it cannot beat. ``x_*`` is the whole token stream (``y_*`` is empty): the LM
    families cut windows from it."""
    g = _gen(seed, 3)
    nexts = torch.stack([torch.randperm(vocab, generator=g)[:branching]
                         for _ in range(vocab * vocab)])                    # [V*V, branching]
    # numpy's Dirichlet from a seeded generator: torch's samples from the global generator.
    rng = np.random.default_rng(seed * 7919 + 3)
    probs = torch.from_numpy(rng.dirichlet(np.full(branching, 0.6), size=vocab * vocab))
    cdf = probs.cumsum(1).float()
    cdf[:, -1] = 1.0  # no draw may fall past the last choice by rounding
    # Many chains side by side (a loop over time steps, not over symbols), concatenated: the
    # few joins between chains are the only transitions the chain itself would not make.
    n = n_train + n_held
    chains = 256
    length = -(-n // chains)
    a = torch.randint(vocab, (chains,), generator=g)
    b = torch.randint(vocab, (chains,), generator=g)
    u = torch.rand(length, chains, generator=g)
    out = torch.empty(length, chains, dtype=torch.long)
    for t in range(length):
        row = a * vocab + b
        k = torch.searchsorted(cdf[row], u[t, :, None]).squeeze(1).clamp_(max=branching - 1)
        a, b = b, nexts[row, k]
        out[t] = b
    out = out.t().reshape(-1)[:n]
    empty = torch.empty(0, dtype=torch.long)
    return Split(out[:n_train], empty, out[n_train:], empty)


def topic_bags(seed: int, vocab: int, classes: int = 8, tokens: int = 16, n_train: int = 8192,
               n_held: int = 1024, topic_share: float = 0.4) -> Split:
    """Bags of token ids for the embedding-bag model: each class owns a random set of
    ``vocab // classes`` topic tokens; a sample of class c draws each of its ``tokens`` ids from
    c's topic with probability ``topic_share``, else uniformly from the whole vocabulary. Token
    frequencies are Zipf-like inside each topic, so some table rows are rare (small, intermittent
    gradients; some never seen in a short warmup: held elements)."""
    g = _gen(seed, 4)
    topic_size = vocab // classes
    topics = torch.randperm(vocab, generator=g)[:classes * topic_size].view(classes, topic_size)
    zipf = 1.0 / torch.arange(1, topic_size + 1, dtype=torch.float32)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(classes, (n,), generator=g)
        in_topic = torch.multinomial(zipf, n * tokens, replacement=True, generator=g)
        topical = topics[y.repeat_interleave(tokens), in_topic].view(n, tokens)
        uniform = torch.randint(vocab, (n, tokens), generator=g)
        pick = torch.rand(n, tokens, generator=g) < topic_share
        return torch.where(pick, topical, uniform), y

    x_train, y_train = make(n_train)
    x_held, y_held = make(n_held)
    return Split(x_train, y_train, x_held, y_held)


def teacher_classes(seed: int, dim: int = 32, classes: int = 10, n_train: int = 8192,
                    n_held: int = 1024, temperature: float = 1.0) -> Split:
    """Gaussian inputs labelled by a random two-layer ReLU teacher: the label is sampled from
    softmax(teacher(x) / temperature), so the Bayes loss is well above zero."""
    g = _gen(seed, 5)
    w1 = torch.randn(dim, 64, generator=g) / dim ** 0.5
    w2 = torch.randn(64, classes, generator=g) * (3.0 / 64 ** 0.5)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, dim, generator=g)
        logits = torch.relu(x @ w1) @ w2 / temperature
        y = torch.multinomial(torch.softmax(logits, 1), 1, generator=g).squeeze(1)
        return x, y

    x_train, y_train = make(n_train)
    x_held, y_held = make(n_held)
    return Split(x_train, y_train, x_held, y_held)

