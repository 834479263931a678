"""Sharding: ranks read disjoint samples whose union is the single-process stream, for synthetic and file
data."""

import re
from pathlib import Path

import numpy as np
import pytest

from workloads.data import Shard, SyntheticTokens, TokenFile, micro_batches, token_dtype
from workloads.spec import PRESETS, resolve

pytestmark = pytest.mark.unit


def union_over_ranks(source, world, micro, accum, step):
    rows = []
    for r in range(world):
        for x, y in micro_batches(source, Shard(r, world, micro, accum), step):
            rows.append(np.concatenate([x, y[:, -1:]], axis=1))
    return np.concatenate(rows)


@pytest.mark.parametrize("world,micro,accum", [(2, 4, 1), (4, 2, 1), (2, 2, 2), (8, 1, 1)])
def test_union_over_ranks_equals_single_process_stream(world, micro, accum):
    src = SyntheticTokens(vocab_size=97, seq_len=16, seed=3)
    single = union_over_ranks(src, 1, micro * accum * world, 1, step=5)
    sharded = union_over_ranks(src, world, micro, accum, step=5)
    assert np.array_equal(single, sharded)


def test_shards_are_disjoint_and_cover_the_global_batch():
    world, micro, accum = 4, 3, 2
    ids = [set(Shard(r, world, micro, accum).sample_ids(m)) for r in range(world) for m in range(accum)]
    assert sum(len(s) for s in ids) == len(set().union(*ids)) == world * micro * accum
    assert set().union(*ids) == set(range(world * micro * accum))


def test_synthetic_is_deterministic_learnable_and_step_dependent():
    src = SyntheticTokens(vocab_size=50, seq_len=32, seed=0)
    a, b = src.samples(1, range(4)), SyntheticTokens(50, 32, seed=0).samples(1, range(4))
    assert np.array_equal(a, b) and a.shape == (4, 33) and a.max() < 50
    assert not np.array_equal(a, src.samples(2, range(4)))
    # every transition is one of the table's successors: the structure a model can learn
    for row in a:
        for prev, nxt in zip(row[:-1], row[1:]):
            assert nxt in src.successors[prev]


def test_token_file_windows_shard_the_same_way(tmp_path):
    tokens = np.arange(10_000, dtype=np.uint16) % 300
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    src = TokenFile(path, vocab_size=300, seq_len=8, global_batch=4)
    single = union_over_ranks(src, 1, 4, 1, step=2)
    assert np.array_equal(single, union_over_ranks(src, 2, 2, 1, step=2))
    assert np.array_equal(single[0], tokens[2 * 4 * 9 : 2 * 4 * 9 + 9])  # step 2, sample 0: window 8


def test_token_file_rejects_out_of_vocab_tokens(tmp_path):
    path = tmp_path / "bad.bin"
    np.full(100, 500, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="vocab_size"):
        TokenFile(path, vocab_size=300, seq_len=8, global_batch=2).samples(0, range(1))


@pytest.mark.parametrize("vocab,width", [(50_257, np.uint16), (65_536, np.uint16), (128_256, np.uint32)])
def test_token_files_are_as_wide_as_the_vocabulary_needs_and_read_back_intact(tmp_path, vocab, width):
    """GPT-2's vocabulary fits uint16 token files; Llama 3's 128,256 needs uint32, and its ids above 65,535
    come back intact through the sharded windows every rank reads."""
    assert token_dtype(vocab) == np.dtype(width)
    tokens = (np.arange(20_000, dtype=np.int64) * 7919 + vocab - 20_000) % vocab
    path = tmp_path / "train.bin"
    tokens.astype(token_dtype(vocab)).tofile(path)
    src = TokenFile(path, vocab_size=vocab, seq_len=16, global_batch=4)
    single = union_over_ranks(src, 1, 4, 1, step=1)
    assert np.array_equal(single, union_over_ranks(src, 2, 2, 1, step=1))
    assert np.array_equal(single[0], tokens[4 * 17 : 5 * 17])  # step 1, sample 0: window 4
    assert single.max() >= 65_536 if vocab > 65_536 else single.max() < 65_536


def test_a_vocabulary_above_16_bits_is_a_valid_spec():
    assert resolve("tiny", vocab_size=128_256).vocab_size == 128_256
    assert PRESETS["tiny"].vocab_size <= 65_536


def test_token_files_are_read_in_one_place_with_the_vocabularys_width():
    """Every stack reads token files through workloads.data (backends.loop's make_source, the doctor's data
    check): a worker or model that memory-maps a file itself, or names a 16-bit dtype (np.uint16, "uint16"),
    would misread a vocabulary above 65,536."""
    root = Path(__file__).resolve().parents[1]
    readers = sorted(
        str(path.relative_to(root))
        for folder in ("backends", "workloads", "harness", "core")
        for path in (root / folder).rglob("*.py")
        if re.search(r"np\.(memmap|fromfile)|\.uint16\b|[\"']uint16[\"']", path.read_text())
    )
    assert readers == ["workloads/data.py"]
