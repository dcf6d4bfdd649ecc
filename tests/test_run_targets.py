"""examples/run_targets.py's port base: random below the ephemeral range, so runs at once rarely collide."""

from __future__ import annotations

import importlib.util
import socket
import sys

from helpers import REPO, ports_free

spec = importlib.util.spec_from_file_location("run_targets", REPO / "examples" / "run_targets.py")
run_targets = sys.modules["run_targets"] = importlib.util.module_from_spec(spec)  # its dataclass looks it up
spec.loader.exec_module(run_targets)


def test_port_bases_are_random_free_and_below_the_ephemeral_range():
    bases = [run_targets.free_base(8) for _ in range(10)]
    # A scan from a fixed start gives every run (and a test run beside it) the same base.
    assert len(set(bases)) > 1, bases
    assert all(20000 <= b and b + 8 <= 32000 for b in bases), bases  # Linux's ephemeral ports start at 32768


def test_a_taken_port_is_skipped_and_a_full_range_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        if ports_free([port + 1]):  # [port, port + 2) holds two bases of one port: the taken one and the next
            assert {run_targets.free_base(1, port, port + 2) for _ in range(20)} == {port + 1}
        try:
            run_targets.free_base(1, port, port + 1)
        except RuntimeError as e:
            assert str(e) == f"no 1 consecutive free ports in [{port}, {port + 1})"
        else:
            raise AssertionError("a range whose only port is taken gave a base")
