"""Predict house prices for the test rows with the model train.py saved, and print the test MSE.

Run it in the job directory (node 0's ``ROOT_DIR/<job>``) after training: ``python infer.py`` loads the
newest ``output/pass-*/params.npz``; ``--model-dir output/pass-00004`` picks another pass.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from train import build_model, columns, load_housing, mse

from paddle_cluster.ps import load_dense
from paddle_cluster.train.layers import set_dense_values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", help="default: the newest output/pass-*")
    ap.add_argument("--show", type=int, default=5, help="how many predictions to print")
    args = ap.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        found = sorted(glob.glob(os.path.join("output", "pass-*")))
        if not found:
            print("infer: no output/pass-* here; run it in the job directory after training", file=sys.stderr)
            return 1
        model_dir = found[-1]

    model = build_model()
    set_dense_values(model, load_dense(os.path.join(model_dir, "params.npz")))
    _, test = load_housing()
    x, y = columns(test)
    pred = model.forward(x)
    for i in range(min(args.show, len(test))):
        print(f"row {i}: predicted {pred[i, 0]:.2f}, actual {y[i, 0]:.2f}")
    print(f"model {model_dir}: {len(test)} test rows")
    print(f"test_mse={float(str(mse(model, test)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
