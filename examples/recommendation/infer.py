"""Predict ratings with a model saved by train.py, and report its RMSE on the test split.

    python infer.py [--model output/pass-00005] [--data DIR] [--pair USER:MOVIE ...]

Without ``--model`` the newest ``output/pass-*`` is used. The test split is recomputed from the saved
config (split seed and fraction) over the ratings in ``--data`` (default: the directory the model was
trained on). Needs no pserver: the dense model and the embedding rows are read from the saved files.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

import movielens
import numpy as np
from model import Recommender, predict, rmse

from paddle_cluster.ps import load_dense
from paddle_cluster.train.layers import set_dense_values


def latest_model(output: str) -> str:
    found = sorted(glob.glob(os.path.join(output, "pass-*", "params.npz")))
    if not found:
        raise FileNotFoundError(f"no saved model ({output}/pass-*/params.npz): run train.py first")
    return os.path.dirname(found[-1])


def load_model(model_dir: str) -> Tuple[Dict[str, object], Recommender, Dict[str, Tuple[np.ndarray, np.ndarray]]]:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    model = Recommender(int(config["emb_size"]), int(config["n_jobs"]), 0.0)
    set_dense_values(model, load_dense(os.path.join(model_dir, "params.npz")))
    with np.load(os.path.join(model_dir, "embeddings.npz"), allow_pickle=False) as z:
        tables = {name: (z[f"{name}.ids"], z[f"{name}.rows"]) for name in model.table_widths()}
    return config, model, tables


def parse_pair(text: str) -> Tuple[int, int]:
    user, sep, movie = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected USER:MOVIE")
    return int(user), int(movie)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a pass directory written by train.py (default: the newest in --output)")
    ap.add_argument("--output", default="output")
    ap.add_argument("--data", help="MovieLens directory (default $MOVIELENS_DIR, else the one trained on)")
    ap.add_argument("--pair", type=parse_pair, action="append", default=[], metavar="USER:MOVIE",
                    help="print the predicted rating of this pair (repeatable)")
    args = ap.parse_args(argv)
    try:
        model_dir = args.model or latest_model(args.output)
        config, model, tables = load_model(model_dir)
        data_dir = args.data or os.environ.get("MOVIELENS_DIR") or str(config["data_dir"])
        ds = movielens.load(data_dir)
    except (OSError, KeyError, ValueError) as e:
        print(f"infer: {e}", file=sys.stderr)
        return 2
    if len(ds.ratings) != config.get("ratings"):
        print(f"infer: warning: {data_dir} has {len(ds.ratings)} ratings, the model was trained on a file with "
              f"{config.get('ratings')}: the test split differs", file=sys.stderr)
    for user, movie in args.pair:
        pred = predict(model, ds, np.array([[user, movie, 0]], dtype=np.int64), tables)[0]
        title = ds.movie_title.get(movie, "?")
        print(f"user {user} movie {movie} ({title}): predicted rating {pred:.3f}")
    _, test_idx = movielens.split(len(ds.ratings), float(config["test_fraction"]), int(config["split_seed"]))
    test = ds.ratings[test_idx]
    value = rmse(predict(model, ds, test, tables), test[:, 2])
    print(f"model {model_dir}: test_rmse={value:.7g} on {len(test)} test ratings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
