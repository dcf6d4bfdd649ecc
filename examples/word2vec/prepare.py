"""Split ptb.train.txt into SPLIT_COUNT shards for the cluster job (seed 000's prepare.py).

    python prepare.py --data /path/to/ptb --split-count 2 [--out DIR]

Writes into ``--out`` (default: ``data/`` next to this script, so ``--job_dispatch_package`` ships it and
trainers find it as ``--data data``):

* ``train.txt-00000`` ... ``train.txt-<SPLIT_COUNT-1>``: line i of ptb.train.txt goes to shard
  ``i % SPLIT_COUNT`` (``paddle_cluster.train.data.split_file``); trainer i reads shard i (see
  ``imikolov.trainer_part`` when the trainer count differs);
* ``word_dict.txt``: the vocabulary of the whole training text (``word<TAB>count``, line = id), so every
  trainer uses the same ids while reading only its own shard;
* ``shards.json``: lines, words and N-gram samples per shard (trainers size their sync steps with it);
* copies of ``ptb.valid.txt`` and ``ptb.test.txt`` for trainer 0's evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import List, Optional

import imikolov

from paddle_cluster.train.data import split_file

HERE = os.path.dirname(os.path.abspath(__file__))


def default_split_count() -> int:
    text = os.environ.get("SPLIT_COUNT", "2")
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"SPLIT_COUNT={text!r}: expected a whole number") from None


def prepare(data: str, out: str, split_count: int, min_freq: int = 1) -> List[str]:
    """Write shards, vocabulary, shards.json and the evaluation files; returns the shard paths."""
    src = os.path.join(data, imikolov.TRAIN)
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src} does not exist (--data must hold the PTB files)")
    os.makedirs(out, exist_ok=True)
    for old in imikolov.shard_paths(out):  # a previous split into more parts must not linger
        os.unlink(old)
    parts = split_file(src, split_count, os.path.join(out, imikolov.SHARD_PREFIX))
    lines = imikolov.read_lines(src)
    word_idx = imikolov.build_dict(lines, min_freq)
    imikolov.save_dict(word_idx, os.path.join(out, imikolov.DICT_FILE), imikolov.count_words(lines))
    shards = []
    for p in parts:
        part = imikolov.read_lines(p)
        shards.append({"file": os.path.basename(p), "lines": len(part), "words": sum(len(s.split()) for s in part),
                       "samples": imikolov.n_samples(part)})
    meta = {"source": os.path.abspath(src), "split_count": split_count, "mode": "round_robin",
            "min_freq": min_freq, "vocab": len(word_idx), "shards": shards}
    with open(os.path.join(out, imikolov.SHARDS_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    for name in (imikolov.VALID, imikolov.TEST):
        p = os.path.join(data, name)
        if os.path.isfile(p) and os.path.abspath(p) != os.path.abspath(os.path.join(out, name)):
            shutil.copyfile(p, os.path.join(out, name))
    return parts


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="directory with ptb.train.txt (and ptb.valid.txt, ptb.test.txt)")
    ap.add_argument("--out", default=os.path.join(HERE, "data"), help="where to write (default: %(default)s)")
    ap.add_argument("--split-count", "--split_count", type=int, default=None,
                    help="number of shards (default: $SPLIT_COUNT, else 2)")
    ap.add_argument("--min-freq", "--min_freq", type=int, default=1, help="vocabulary: keep words seen this often")
    args = ap.parse_args(argv)
    n = args.split_count if args.split_count is not None else default_split_count()
    if n < 1 or args.min_freq < 1:
        ap.error("--split-count and --min-freq must be >= 1")
    try:
        parts = prepare(args.data, args.out, n, args.min_freq)
    except (OSError, ValueError) as e:
        print(f"prepare.py: {e}", file=sys.stderr)
        return 2
    meta = imikolov.read_shards_meta(args.out)
    print(f"{len(parts)} shard(s) in {args.out}: " + ", ".join(
        f"{s['file']} ({s['lines']} lines, {s['samples']} samples)" for s in meta["shards"]))
    print(f"vocabulary: {meta['vocab']} words (min_freq {args.min_freq}) in {imikolov.DICT_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
