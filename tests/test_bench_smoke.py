"""The benchmark suite runs (tiny sizes) and every correctness check in it passes. Timings are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_bench_smoke_raw_dense_sparse(tmp_path):
    out = tmp_path / "latest.json"
    res = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--only", "raw,dense,sparse", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=170, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["preset"] == "smoke" and not doc["failed_sections"]
    rows = doc["rows"]
    assert {r["section"] for r in rows} >= {"raw", "dense", "sparse", "memory"}
    assert all(not r["check"].startswith("FAILED") for r in rows), [r for r in rows if r["check"] != "ok"]
    assert all(r["value"] is not None and r["value"] > 0 for r in rows)
    # The data-path and integrity goals, each with a figure and PASS/MISS.
    want = {"dense push+pull / raw TCP 2 streams (integrity off)", "integrity on / off: dense push+pull",
            "integrity on / off: 2-trainer sync", "2-trainer sync aggregate / raw TCP 2 streams (integrity off)",
            "pserver 0 memory / design, 2 trainers sync"}
    got = {t["name"]: t for t in doc["targets"] if t["name"] in want}
    assert set(got) == want and all(t["met"] is not None and t["value"] is not None for t in got.values()), got
    # Memory judged against the design's bytes, the raw growth over the parameters still in the JSON.
    assert all(r["extra"]["raw"] > 0 and r["extra"]["design"] > 0 for r in rows if r["section"] == "memory")
    # The CPU of every data-path row's processes, the SGD path alone, and each data-path goal's CPU bound or
    # why there is none.
    assert all("cpu" in r["extra"] for r in rows if r["section"] == "raw" or "pushpull" in r["name"]
               or "aggregate" in r["name"])
    assert sum("SGD path alone" in r["name"] for r in rows if r["section"] == "cpu") == 2
    assert all(t["bound"] is not None or "no CPU bound" in t["detail"] for t in got.values() if "raw TCP" in t["name"])
    # Integrity on and off in the same run, each checked.
    dense = {r["name"] for r in rows if r["section"] == "dense"}
    assert any("integrity on" in n for n in dense) and any("integrity off" in n for n in dense)
    assert (tmp_path / "block_sweep.png").exists()
    assert "targets:" in res.stdout and ("PASS" in res.stdout or "MISS" in res.stdout)
