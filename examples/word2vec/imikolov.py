"""PTB (imikolov) text -> vocabulary, N-gram samples and per-trainer shards, like ``paddle.dataset.imikolov``.

Vocabulary (``build_dict``): every word of the training text, with ``<s>`` and ``<e>`` counted once per
sentence as Paddle does, kept when its count is >= ``min_freq``, sorted by (-count, word); ``<unk>`` gets
an id too (PTB already uses it for rare words, so with ``min_freq=1`` the vocabulary is the 9,999 words of
ptb.train.txt plus ``<s>`` and ``<e>``: 10,001 ids). Words outside it map to ``<unk>``.

Samples (``ngrams``): each sentence becomes ``<s>`` x (N-1) + words + ``<e>`` and yields one N-gram per
word and per ``<e>`` -- the N-1 ids before it are the context, it is the target. Unlike Paddle's reader
(one ``<s>``, the first N-1 words never predicted) every token and the end of sentence is predicted, so
the perplexity counts the same events as the usual PTB numbers (tokens + one end-of-sentence each).

Data directory: ``ptb.{train,valid,test}.txt`` and/or what ``prepare.py`` writes there
(``train.txt-00000`` ..., ``word_dict.txt``, ``shards.json``).
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

BOS, EOS, UNK = "<s>", "<e>", "<unk>"
TRAIN, VALID, TEST = "ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"
SHARD_PREFIX = "train.txt"
DICT_FILE = "word_dict.txt"
SHARDS_FILE = "shards.json"


def read_lines(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def count_words(lines: Iterable[str]) -> Counter:
    """Word counts with ``<s>``/``<e>`` once per sentence (as Paddle's build_dict counts them)."""
    c: Counter = Counter()
    for line in lines:
        c.update(line.split())
        c[BOS] += 1
        c[EOS] += 1
    return c


def build_dict(lines: Iterable[str], min_freq: int = 1) -> Dict[str, int]:
    """word -> id: words with count >= min_freq by (-count, word); ``<unk>`` kept or appended last."""
    c = count_words(lines)
    words = sorted((w for w, n in c.items() if n >= min_freq), key=lambda w: (-c[w], w))
    # Paddle appends <unk> unconditionally, which leaves a hole where PTB's own <unk> was; keep its id.
    if UNK not in words:
        words.append(UNK)
    if BOS not in words or EOS not in words:
        raise ValueError(f"min_freq={min_freq} drops <s>/<e>: it must not exceed the number of sentences")
    return {w: i for i, w in enumerate(words)}


def save_dict(word_idx: Dict[str, int], path: str, counts: Optional[Counter] = None) -> None:
    """One ``word<TAB>count`` line per id, in id order (text, so loading never unpickles)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for w, _ in sorted(word_idx.items(), key=lambda kv: kv[1]):
            f.write(f"{w}\t{counts[w] if counts is not None else 0}\n")
    os.replace(tmp, path)


def load_dict(path: str) -> Dict[str, int]:
    with open(path, encoding="utf-8") as f:
        words = [line.split("\t")[0] for line in f if line.strip()]
    if len(set(words)) != len(words) or UNK not in words:
        raise ValueError(f"{path}: duplicate words or no {UNK}")
    return {w: i for i, w in enumerate(words)}


def ngrams(lines: Iterable[str], word_idx: Dict[str, int], n: int = 5) -> np.ndarray:
    """(samples, n) int32: columns 0..n-2 the context, column n-1 the target (see the module doc)."""
    if n < 2:
        raise ValueError("N must be >= 2")
    unk, pad = word_idx[UNK], [word_idx[BOS]] * (n - 1)
    end = word_idx[EOS]
    seqs = []
    for line in lines:
        ids = pad + [word_idx.get(w, unk) for w in line.split()] + [end]
        seqs.append(np.asarray(ids, dtype=np.int32))
    if not seqs:
        return np.empty((0, n), dtype=np.int32)
    out = [np.lib.stride_tricks.sliding_window_view(s, n) for s in seqs]
    return np.ascontiguousarray(np.concatenate(out))


def n_samples(lines: Iterable[str]) -> int:
    """How many N-grams ``ngrams`` makes of these lines (one per word and one per sentence end)."""
    return sum(len(line.split()) + 1 for line in lines)


# -- the data directory ------------------------------------------------------------------------------


def shard_paths(data_dir: str) -> List[str]:
    return sorted(glob.glob(os.path.join(data_dir, f"{SHARD_PREFIX}-[0-9][0-9][0-9][0-9][0-9]")))


def trainer_part(n_shards: int, trainer_id: int, trainers: int) -> Tuple[List[int], int, int]:
    """Which shards trainer ``trainer_id`` reads, and which of their lines: ``(shards, r, g)`` means lines
    ``r::g`` of each listed shard.

    S shards, T trainers: S == T -> trainer i reads shard i; S > T -> shards i, i+T, ... (whole); S < T ->
    the trainers i, i+S, i+2S, ... share shard i % S and take its lines round robin. Every line of every
    shard goes to exactly one trainer.
    """
    if not 0 <= trainer_id < trainers:
        raise ValueError(f"trainer_id={trainer_id} must be in [0, {trainers})")
    if n_shards < 1:
        raise ValueError("no shards")
    if n_shards >= trainers:
        return list(range(trainer_id, n_shards, trainers)), 0, 1
    k = trainer_id % n_shards
    group = len(range(k, trainers, n_shards))
    return [k], trainer_id // n_shards, group


def train_lines(data_dir: str, trainer_id: int = 0, trainers: int = 1) -> Tuple[List[str], str]:
    """This trainer's training sentences and a description of where they came from.

    Prepared shards win over ``ptb.train.txt``; from the whole file, trainer i takes lines i::T (what
    ``prepare.py --split-count T`` would have put in shard i).
    """
    shards = shard_paths(data_dir)
    if shards:
        ids, r, g = trainer_part(len(shards), trainer_id, trainers)
        lines = [line for k in ids for line in read_lines(shards[k])[r::g]]
        names = ", ".join(os.path.basename(shards[k]) for k in ids)
        return lines, f"{names}" + (f" (lines {r}::{g})" if g > 1 else "")
    path = os.path.join(data_dir, TRAIN)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{data_dir}: neither {SHARD_PREFIX}-NNNNN shards (prepare.py) nor {TRAIN}")
    return read_lines(path)[trainer_id::trainers], f"{TRAIN} (lines {trainer_id}::{trainers})"


def all_train_lines(data_dir: str) -> List[str]:
    """The whole training text (all shards, or ptb.train.txt)."""
    shards = shard_paths(data_dir)
    if shards:
        return [line for p in shards for line in read_lines(p)]
    return read_lines(os.path.join(data_dir, TRAIN))


def load_vocab(data_dir: str, min_freq: int = 1) -> Tuple[Dict[str, int], str]:
    """The vocabulary prepare.py saved (if it was built with the same min_freq), else built from the
    whole training text; returns it and where it came from."""
    path = os.path.join(data_dir, DICT_FILE)
    meta = read_shards_meta(data_dir)
    if os.path.isfile(path) and meta is not None and meta.get("min_freq") == min_freq:
        return load_dict(path), path
    return build_dict(all_train_lines(data_dir), min_freq), "the training text"


def read_shards_meta(data_dir: str) -> Optional[dict]:
    path = os.path.join(data_dir, SHARDS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def total_train_samples(data_dir: str) -> int:
    """N-grams in the whole training text: from shards.json when prepare.py wrote it, else counted."""
    meta = read_shards_meta(data_dir)
    shards = shard_paths(data_dir)
    if meta is not None and [os.path.basename(p) for p in shards] == [s["file"] for s in meta["shards"]]:
        return sum(int(s["samples"]) for s in meta["shards"])
    return n_samples(all_train_lines(data_dir))


def eval_path(data_dir: str, name: str) -> Optional[str]:
    p = os.path.join(data_dir, name)
    return p if os.path.isfile(p) else None

