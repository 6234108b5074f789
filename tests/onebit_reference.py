"""A NumPy reference of the 1-bit allreduce, written straight from ALGORITHM.md.

It simulates all n ranks in one process: worker compression, stage 1, server step, stage 2 and
decode, with both error-feedback buffers. Tests compare the real multi-rank collective (and the
kernels) against it. Deliberately simple: loops and float64 sums, no shared code with the package.
"""
from __future__ import annotations

import numpy as np


def adam_bound(t: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The largest |m_hat| / sqrt(v_hat) Adam can reach at step t: Cauchy-Schwarz on its two
    running averages (ALGORITHM.md), the bound the compression phase clamps each step at."""
    r = beta1 ** 2 / beta2
    return ((1 - beta1) / (1 - beta1 ** t) * np.sqrt((1 - r ** t) / (1 - r))
            * np.sqrt((1 - beta2 ** t) / (1 - beta2)))


def _compress(y: np.ndarray, block: int):
    """y float32 [chunk] -> (scales float32 [nblocks], signs +-1 float32 [chunk], error float32)."""
    blocks = y.reshape(-1, block)
    sumsq = (blocks.astype(np.float64) ** 2).sum(axis=1)
    scales = np.sqrt(sumsq / block).astype(np.float32)
    signs = np.where(blocks >= 0, np.float32(1), np.float32(-1))
    approx = (signs * scales[:, None]).astype(np.float32)
    err = (blocks - approx).astype(np.float32)
    return scales, signs.reshape(-1), approx.reshape(-1), err.reshape(-1)


class ReferenceOneBit:
    """All ranks of one OneBitAllreduce, in NumPy."""

    def __init__(self, numel: int, n: int, block_size: int | None = None):
        self.numel, self.n = numel, n
        chunk = -(-numel // (8 * n)) * 8
        if block_size is not None and block_size < chunk:
            chunk = -(-chunk // block_size) * block_size
            block = block_size
        else:
            block = chunk
        self.chunk, self.block = chunk, block
        self.worker_err = [np.zeros(n * chunk, np.float32) for _ in range(n)]
        self.server_err = [np.zeros(chunk, np.float32) for _ in range(n)]

    def allreduce(self, inputs: list[np.ndarray]) -> np.ndarray:
        """inputs: one float32 [numel] array per rank. Returns the float32 [numel] output."""
        n, chunk, block = self.n, self.chunk, self.block
        if n == 1 or self.numel == 0:
            return inputs[0].astype(np.float32).copy()
        decoded = []  # decoded[i][j]: rank i's compressed chunk j
        for i in range(n):
            x = np.zeros(n * chunk, np.float32)
            x[: self.numel] = inputs[i]
            y = (x + self.worker_err[i]).astype(np.float32)
            parts = []
            for j in range(n):
                _, _, approx, err = _compress(y[j * chunk:(j + 1) * chunk], block)
                self.worker_err[i][j * chunk:(j + 1) * chunk] = err
                parts.append(approx)
            decoded.append(parts)
        out = np.zeros(n * chunk, np.float32)
        for j in range(n):  # rank j is the server of chunk j
            acc = np.zeros(chunk, np.float32)
            for i in range(n):
                acc = (acc + decoded[i][j]).astype(np.float32)
            z = (acc / np.float32(n) + self.server_err[j]).astype(np.float32)
            _, _, approx, err = _compress(z, block)
            self.server_err[j] = err
            out[j * chunk:(j + 1) * chunk] = approx
        return out[: self.numel]


class ReferenceHierarchical:
    """All ranks of one hierarchical 1-bit allreduce (ALGORITHM.md, "Hierarchical variant"), in
    NumPy: ``nodes`` nodes of ``per_node`` ranks; rank = node * per_node + local rank."""

    def __init__(self, numel: int, nodes: int, per_node: int, block_size: int | None = None):
        self.numel, self.nodes, self.per_node = numel, nodes, per_node
        self.shard = max(1, -(-numel // per_node))
        # one 1-bit allreduce per local rank i, among the nodes, of shard i
        self.groups = [ReferenceOneBit(self.shard, nodes, block_size) for _ in range(per_node)]

    def allreduce(self, inputs: list[np.ndarray]) -> np.ndarray:
        """inputs: one float32 [numel] array per rank. Returns the float32 [numel] output."""
        L, S = self.per_node, self.shard
        padded = []
        for x in inputs:
            p = np.zeros(L * S, np.float32)
            p[: self.numel] = x
            padded.append(p)
        out = np.zeros(L * S, np.float32)
        for i in range(L):
            node_means = []
            for k in range(self.nodes):  # the node's ranks summed in local-rank order, float32
                acc = padded[k * L][i * S:(i + 1) * S].copy()
                for j in range(1, L):
                    acc = (acc + padded[k * L + j][i * S:(i + 1) * S]).astype(np.float32)
                node_means.append((acc / np.float32(L)).astype(np.float32))
            out[i * S:(i + 1) * S] = self.groups[i].allreduce(node_means)
        return out[: self.numel]
