"""Offline search for two 16-token blocks whose Python ``hash()`` tuples collide.

Not a test: run it by hand (about a minute, 1 GiB of RAM) to produce the input data of
``test_prefix_cache_keys.py``. CPython (3.8+) hashes a tuple of small ints with an xxHash-like
round per item, ``acc = rotl(acc + item * P2, 31) * P1``, so two prefixes whose states satisfy
``acc - acc' == (t' - t) * P2 (mod 2**64)`` for tokens t, t' merge after one more item; a sorted
birthday search over ``acc * P2**-1`` finds such a pair among ~2**25 random 3-token prefixes.

    python tests/engine/hash_collision_search.py [--vocab 49152] [--seed 0]
"""

from __future__ import annotations

import argparse

import numpy as np

P1 = np.uint64(11400714785074694791)
P2 = np.uint64(14029467366897019727)
P5 = np.uint64(2870177450012600261)
P2_INV = np.uint64(pow(14029467366897019727, -1, 2**64))
BLOCK_SIZE = 16
PREFIX_LEN = 3
LOW = 100  # stay clear of special tokens


def _round(acc: np.ndarray, lane: np.ndarray) -> np.ndarray:
    acc = acc + lane * P2
    acc = (acc << np.uint64(31)) | (acc >> np.uint64(33))
    return acc * P1


def search(vocab: int, seed: int, num: int = 2**25) -> tuple[list[int], list[int]] | None:
    """One round of the birthday search; two colliding blocks, or None."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(LOW, vocab, size=(num, PREFIX_LEN), dtype=np.uint64)
    acc = np.full(num, P5, dtype=np.uint64)
    for i in range(PREFIX_LEN):
        acc = _round(acc, prefixes[:, i])
    y = acc * P2_INV
    order = np.argsort(y)
    gaps = np.diff(y[order])
    max_gap = vocab - 1 - LOW
    for j in np.flatnonzero((gaps > 0) & (gaps <= max_gap)):
        lo, hi = order[j], order[j + 1]  # y[hi] - y[lo] = gap = t_lo - t_hi
        gap = int(gaps[j])
        tail = [int(t) for t in rng.integers(LOW, vocab, size=BLOCK_SIZE - PREFIX_LEN - 1)]
        a = [int(t) for t in prefixes[lo]] + [LOW + gap] + tail
        b = [int(t) for t in prefixes[hi]] + [LOW] + tail
        if a != b and hash(tuple(a)) == hash(tuple(b)):
            return a, b
    return None


def main() -> None:
    """Search rounds until a pair is found; print it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with np.errstate(over="ignore"):
        for seed in range(args.seed, args.seed + 100):
            found = search(args.vocab, seed)
            if found:
                a, b = found
                print(f"BLOCK_A = {a}\nBLOCK_B = {b}\nhash = {hash(tuple(a))}")
                return
            print(f"seed {seed}: no pair, next round")


if __name__ == "__main__":
    main()
