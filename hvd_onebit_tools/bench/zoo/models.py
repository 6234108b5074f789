"""The zoo's model families: a network, its data, its loss and how its batches are drawn.

Each :class:`Family` builds a :class:`Task` from a seed and a learning rate: the model
(initialised from the seed alone, so every rank and every run starts alike), its local torch
optimizer (not yet distributed), the data, a batch sampler seeded from (seed, rank) and the
held-out loss. Nothing here talks to Horovod: the rank worker (``worker.py``) wraps the optimizer
and reduces the held-out sums across ranks.

The families are kept small (20-40K parameters, a few ms a step) so that the whole zoo, 378 runs
on 4 ranks sharing two cores, fits in about half an hour.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import data as zdata

Batch = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Tasks: what the worker trains.
# ---------------------------------------------------------------------------------------------

@dataclass
class Task:
    """One run's model, local optimizer and data.

    ``loss(model, batch)`` is the training loss; ``held_out(rank, world)`` yields this rank's
    share of the held-out batches (every example on exactly one rank); ``sums(model, batch)``
    is (sum of per-example or per-token losses, count) for one of them.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    sums: Callable[[nn.Module, Batch], tuple[float, int]]
    sampler: Callable[[int, int, int], Callable[[], Batch]]
    held_out: Callable[[int, int], list[Batch]]


def classification_task(model: nn.Module, optimizer: torch.optim.Optimizer, split: zdata.Split,
                        batch: int, log_probs: bool = False) -> Task:
    """A classifier on ``split``: cross-entropy (NLL when the model already returns
    log-probabilities, as Horovod's MNIST Net does)."""
    criterion = F.nll_loss if log_probs else F.cross_entropy

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        return criterion(m(b[0]), b[1])

    def sums(m: nn.Module, b: Batch) -> tuple[float, int]:
        return float(criterion(m(b[0]), b[1], reduction="sum")), len(b[1])

    def sampler(seed: int, rank: int, world: int) -> Callable[[], Batch]:
        # Each rank owns every world-th training example (as examples/train_digits.py) and draws
        # its batches with a generator of its own: the order depends on seed and rank only.
        xs, ys = split.x_train[rank::world], split.y_train[rank::world]
        gen = torch.Generator().manual_seed(seed * 1000 + rank)

        def draw() -> Batch:
            ix = torch.randint(len(xs), (batch,), generator=gen)
            return xs[ix], ys[ix]
        return draw

    def held_out(rank: int, world: int) -> list[Batch]:
        xs, ys = split.x_held[rank::world], split.y_held[rank::world]
        return [(xs[i:i + 256], ys[i:i + 256]) for i in range(0, len(xs), 256)]

    return Task(model, optimizer, loss, sums, sampler, held_out)


def lm_task(model: nn.Module, optimizer: torch.optim.Optimizer, train: torch.Tensor,
            held: torch.Tensor, context: int, batch: int, held_windows: int = 128,
            logits_of: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda m, x: m(x)
            ) -> Task:
    """A next-token LM on a token stream: random windows of ``context + 1`` tokens from the
    rank's contiguous shard (as examples/train_lm.py), ``held_windows`` fixed non-overlapping
    held-out windows; loss per token."""
    window = context + 1

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        logits = logits_of(m, b[0])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), b[1].reshape(-1))

    def sums(m: nn.Module, b: Batch) -> tuple[float, int]:
        logits = logits_of(m, b[0])
        return (float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), b[1].reshape(-1),
                                      reduction="sum")), b[1].numel())

    def sampler(seed: int, rank: int, world: int) -> Callable[[], Batch]:
        shard_len = len(train) // world
        shard = train[rank * shard_len:(rank + 1) * shard_len]
        gen = torch.Generator().manual_seed(seed * 1000 + rank)

        def draw() -> Batch:
            ix = torch.randint(len(shard) - window, (batch,), generator=gen)
            w = torch.stack([shard[i:i + window] for i in ix.tolist()])
            return w[:, :-1], w[:, 1:]
        return draw

    all_windows = held[:len(held) // window * window].view(-1, window)
    keep = torch.linspace(0, len(all_windows) - 1, min(held_windows, len(all_windows)))
    fixed = all_windows[keep.round().long()]

    def held_out(rank: int, world: int) -> list[Batch]:
        mine = fixed[rank::world]
        return [(mine[i:i + 64, :-1], mine[i:i + 64, 1:]) for i in range(0, len(mine), 64)]

    return Task(model, optimizer, loss, sums, sampler, held_out)


# ---------------------------------------------------------------------------------------------
# Networks.
# ---------------------------------------------------------------------------------------------

class HorovodMnistNet(nn.Module):
    """The ``Net`` of Horovod's examples/pytorch/pytorch_mnist.py, layer for layer (21,840
    parameters): ReLU, max-pool and dropout, the combination on which the unbounded step diverges."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 1, 28, 28]
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


class DropoutCnn(nn.Module):
    """Another ReLU CNN with max-pool and dropout, on 3-channel 16x16 images (38K parameters)."""

    def __init__(self, classes: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.drop2d = nn.Dropout2d(0.25)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 3, 16, 16]
        x = self.drop2d(F.max_pool2d(F.relu(self.conv1(x)), 2))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.dropout(F.relu(self.fc1(x.flatten(1))), 0.5, training=self.training)
        return self.fc2(x)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv+BatchNorm, a 1x1 projection where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


class SmallResNet(nn.Module):
    """A ResNet with BatchNorm: stem, three basic blocks (8, 16, 32 channels, the last two at
    stride 2), global average pool, linear head (17K parameters)."""

    def __init__(self, classes: int = 8, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(width, width), BasicBlock(width, 2 * width, 2),
                                    BasicBlock(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class GruLm(nn.Module):
    """A character-level GRU language model: embedding, one GRU layer, linear head."""

    def __init__(self, vocab: int, embed: int = 16, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, vocab]
        return self.head(self.gru(self.embed(x))[0])


class Mlp(nn.Module):
    """A plain ReLU MLP, the first network anybody writes."""

    def __init__(self, dim: int, classes: int, width: int = 128, depth: int = 2):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(dim if i == 0 else width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@functools.lru_cache(maxsize=1)
def train_lm_module():
    """examples/train_lm.py as a module (it is a script, not part of the package): its model
    builder and its offline text."""
    from ..lm import find_train_lm

    path = find_train_lm()
    spec = importlib.util.spec_from_file_location("hvd_onebit_zoo_train_lm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Families.
# ---------------------------------------------------------------------------------------------

@dataclass
class Family:
    """A model family: ``build(seed, lr, batch)`` makes a fresh :class:`Task`.

    ``base_lr`` is the per-worker learning rate; the zoo runs it and Horovod's ``base_lr * size``.
    ``steps`` and ``batch`` (per rank) are the defaults, chosen so one 4-rank run on two shared
    cores takes a few seconds.
    """

    name: str
    description: str
    base_lr: float
    steps: int
    batch: int
    build: Callable[[int, float, int], Task] = field(repr=False)


def _adam(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=lr)


@functools.lru_cache(maxsize=8)
def _cached(maker: Callable, seed: int, *args) -> zdata.Split:
    # The data of one seed is made once per rank process and reused by all its runs (the runs
    # never modify it).
    return maker(seed, *args)


def _build_mnist(seed: int, lr: float, batch: int) -> Task:
    torch.manual_seed(seed)
    model = HorovodMnistNet()
    return classification_task(model, _adam(model, lr),
                               _cached(zdata.mnist_like_digits, seed, 4096, 512, "clean"),
                               batch, log_probs=True)


def _build_dropout_cnn(seed: int, lr: float, batch: int) -> Task:
    torch.manual_seed(seed)
    model = DropoutCnn()
    return classification_task(model, _adam(model, lr), _cached(zdata.grating_images, seed),
                               batch)


def _build_resnet(seed: int, lr: float, batch: int) -> Task:
    torch.manual_seed(seed)
    model = SmallResNet()
    # 12x12 gratings: the ResNet is the costliest network per pixel here.
    return classification_task(model, _adam(model, lr),
                               _cached(zdata.grating_images, seed, 12), batch)


GRU_VOCAB, GRU_CONTEXT = 32, 24


def _build_gru(seed: int, lr: float, batch: int) -> Task:
    torch.manual_seed(seed)
    model = GruLm(GRU_VOCAB)
    text = _cached(zdata.markov_text, seed, GRU_VOCAB)
    return lm_task(model, _adam(model, lr), text.x_train, text.x_held, GRU_CONTEXT, batch)


TRANSFORMER = dict(context=32, d_model=32, n_layer=2, n_head=2, weight_decay=0.1)


@functools.lru_cache(maxsize=1)
def _byte_text() -> tuple[torch.Tensor, torch.Tensor]:
    text = train_lm_module().load_text()
    n_held = int(len(text) * 0.1)  # the example's split: the last 10% held out
    return text[:-n_held], text[-n_held:]


def _build_transformer(seed: int, lr: float, batch: int) -> Task:
    # The example's own builder: its GPT and AdamW (weight decay on matrices, betas 0.9/0.99).
    args = argparse.Namespace(seed=seed, lr=lr, **TRANSFORMER)
    model, optimizer = train_lm_module().build_model_and_adamw(args)
    train, held = _byte_text()
    return lm_task(model, optimizer, train, held, TRANSFORMER["context"], batch,
                   logits_of=lambda m, x: m(x)[0])


EMBED_VOCAB, EMBED_CLASSES = 2048, 8


def _build_embedding(seed: int, lr: float, batch: int) -> Task:
    from ..train import build_embedding_model

    torch.manual_seed(seed)
    model = build_embedding_model(EMBED_VOCAB, dim=16, width=32, out_dim=EMBED_CLASSES)
    return classification_task(model, _adam(model, lr),
                               _cached(zdata.topic_bags, seed, EMBED_VOCAB, EMBED_CLASSES), batch)


def _build_mlp(seed: int, lr: float, batch: int) -> Task:
    torch.manual_seed(seed)
    model = Mlp(32, 10)
    return classification_task(model, _adam(model, lr), _cached(zdata.teacher_classes, seed),
                               batch)


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("mnist_cnn", "Horovod's pytorch_mnist.py Net on MNIST-shaped digits (black "
           "background)",
           1e-3, 120, 32, _build_mnist),
    Family("dropout_cnn", "ReLU CNN, max-pool, dropout; 3x16x16 grating images",
           1e-3, 120, 32, _build_dropout_cnn),
    Family("resnet_bn", "small ResNet with BatchNorm; 3x12x12 grating images",
           1e-3, 120, 32, _build_resnet),
    Family("gru_lm", "char-level GRU LM on second-order Markov text",
           2e-3, 120, 16, _build_gru),
    Family("transformer_lm", "examples/train_lm.py's GPT (small config) on its own text",
           5e-4, 120, 8, _build_transformer),
    Family("embedding_bag", "bench embedding-bag model on topic bags of tokens",
           1e-3, 120, 32, _build_embedding),
    Family("mlp", "ReLU MLP on a random teacher's labels",
           1e-3, 120, 32, _build_mlp),
]}


def family(name: str) -> Family:
    """The family called ``name``, or a ValueError listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown zoo family {name!r}; choose from {', '.join(FAMILIES)}") \
            from None


def parameter_count(model: nn.Module) -> int:
    """Parameter elements of ``model``."""
    return sum(p.numel() for p in model.parameters())
