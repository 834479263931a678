"""Deterministic token batches, sharded over ranks so that their union is the single-process stream.

A step's global batch is `global_batch` sequences; sample j of step s is a pure function of
(seed, s, j) (synthetic) or of its position in a token file, never of the world size. Rank r, micro-step
m reads samples [r * per_rank + m * micro_batch, ... + micro_batch) with per_rank = micro_batch * accum.
So 1 worker with global batch B and 2 workers with B/2 each see exactly the same sequences.

Each sample is seq_len + 1 tokens: inputs are [:-1], targets [1:].
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

# Synthetic text is a random walk on a sparse successor table (each token has BRANCHING likely
# successors), so a model can learn it: the loss falls from ln(vocab) towards ln(BRANCHING).
BRANCHING = 4


@dataclass(frozen=True)
class Shard:
    """Which slice of each global batch a rank reads."""

    rank: int
    world_size: int
    micro_batch: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    def sample_ids(self, micro_step: int) -> range:
        start = self.rank * self.micro_batch * self.grad_accum + micro_step * self.micro_batch
        return range(start, start + self.micro_batch)


class SyntheticTokens:
    """Markov-chain token sequences from a seed; the successor table is shared by every sample."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        table_rng = np.random.default_rng([seed, 0x5EED])
        self.successors = table_rng.integers(0, vocab_size, size=(vocab_size, BRANCHING), dtype=np.int64)

    def samples(self, step: int, sample_ids: range) -> np.ndarray:
        """int64 array [len(sample_ids), seq_len + 1]."""
        n, length = len(sample_ids), self.seq_len + 1
        choices = np.empty((n, length), np.int64)
        tokens = np.empty((n, length), np.int64)
        for row, j in enumerate(sample_ids):
            rng = np.random.default_rng([self.seed, step, j])
            tokens[row, 0] = rng.integers(0, self.vocab_size)
            choices[row] = rng.integers(0, BRANCHING, size=length)
        for i in range(1, length):  # vectorised over the rows
            tokens[:, i] = self.successors[tokens[:, i - 1], choices[:, i]]
        return tokens


def token_dtype(vocab_size: int) -> np.dtype:
    """The width of a token file for this vocabulary: uint16 (nanoGPT's train.bin) where every id fits,
    else uint32 (Llama 3's 128,256 ids do not fit 16 bits). The one place the width is decided: the
    readers and the doctor's data check take it from here."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class TokenFile:
    """A flat memory-mapped token file of token_dtype(vocab_size) (nanoGPT's train.bin format where uint16).

    Sample j of step s is the window starting at ((s * global_batch + j) * (seq_len + 1)) modulo the
    usable length: consecutive, non-overlapping windows that wrap around at the end of the file.
    """

    def __init__(self, path: str | os.PathLike, vocab_size: int, seq_len: int, global_batch: int):
        self.tokens = np.memmap(path, dtype=token_dtype(vocab_size), mode="r")
        self.seq_len, self.global_batch = seq_len, global_batch
        if len(self.tokens) < seq_len + 1:
            raise ValueError(f"{path}: {len(self.tokens)} tokens, need at least seq_len + 1 = {seq_len + 1}")
        self.n_windows = len(self.tokens) // (seq_len + 1)
        self.vocab_size = vocab_size

    def samples(self, step: int, sample_ids: range) -> np.ndarray:
        length = self.seq_len + 1
        out = np.empty((len(sample_ids), length), np.int64)
        for row, j in enumerate(sample_ids):
            start = ((step * self.global_batch + j) % self.n_windows) * length
            out[row] = self.tokens[start : start + length]
        if out.max(initial=0) >= self.vocab_size:
            raise ValueError(f"token id {int(out.max())} >= vocab_size {self.vocab_size}")
        return out


def make_source(vocab_size: int, seq_len: int, global_batch: int, seed: int = 0, path: str | None = None):
    return (
        TokenFile(path, vocab_size, seq_len, global_batch)
        if path
        else SyntheticTokens(vocab_size, seq_len, seed)
    )


def micro_batches(source, shard: Shard, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """This rank's (inputs, targets) int64 arrays for every micro-step of `step`."""
    out = []
    for m in range(shard.grad_accum):
        seqs = source.samples(step, shard.sample_ids(m))
        out.append((seqs[:, :-1], seqs[:, 1:]))
    return out
