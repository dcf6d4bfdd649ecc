"""Predict house prices for the test rows with the model train.py saved, and print the test MSE.

Run it in the job directory (node 0's ``ROOT_DIR/<job>``) after training: ``python infer.py`` loads the
newest ``output/pass-*/params.npz``; ``--model-dir output/pass-00004`` picks another pass.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from train import build_program, load_housing, samples

from paddle_cluster.train import fluid


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

    program = build_program().clone(for_test=True)
    exe = fluid.Executor(fluid.CPUPlace())
    fluid.io.load_params(exe, model_dir, program)
    _, test = load_housing()
    feed = fluid.DataFeeder(feed_list=["x", "y"]).feed(samples(test))
    pred, mse = exe.run(program, feed=feed, fetch_list=["prediction", "loss"])
    for i in range(min(args.show, len(test))):
        print(f"row {i}: predicted {pred[i, 0]:.2f}, actual {feed['y'][i, 0]:.2f}")
    print(f"model {model_dir}: {len(test)} test rows")
    print(f"test_mse={float(str(mse[0]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
