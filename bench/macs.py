"""``python -m bench.macs``: the frame-MAC candidates on this machine (one core, 4 MiB buffers, best of N).

What the frame MAC (ps/auth.py) was chosen from; the optional packages are measured when installed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
import time
from typing import Callable, Dict, Optional

from paddle_cluster.ps.auth import SUITES
from paddle_cluster.ps.stream import SEGMENT

SIZE = 4 << 20


def best_rate(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return SIZE / best


def candidates(buf: bytes, key: bytes) -> Dict[str, Optional[Callable[[], object]]]:
    mv = memoryview(buf)

    def ours(mac) -> Callable[[], bytes]:  # what a Stream does: start, feed segment by segment, tag each
        def run() -> bytes:
            frame = mac.start(0, b"h" * 40)
            frame.tag()
            for off in range(0, SIZE, SEGMENT):
                frame.update(mv[off:off + SEGMENT])
                frame.tag()
            return b""
        return run

    out: Dict[str, Optional[Callable[[], object]]] = {
        "sha256 (unkeyed, the ceiling)": lambda: hashlib.sha256(buf).digest(),
        "hmac.new(k, buf, sha256)": lambda: hmac.new(key, buf, hashlib.sha256).digest(),
        **{f"frame MAC {m.__name__}, streamed (ours)": ours(m(key)) for m in SUITES.values()},
        "keyed blake2b": lambda: hashlib.blake2b(buf, key=key).digest(),
        "keyed blake2s": lambda: hashlib.blake2s(buf, key=key).digest(),
    }
    try:
        import blake3  # type: ignore

        out["keyed blake3 (PyPI blake3)"] = lambda: blake3.blake3(buf, key=key).digest()
    except ImportError:
        out["keyed blake3 (PyPI blake3)"] = None
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # type: ignore
        from cryptography.hazmat.primitives.poly1305 import Poly1305  # type: ignore

        gcm = AESGCM(key[:16])
        out["AES-GMAC (cryptography)"] = lambda: gcm.encrypt(b"\0" * 12, b"", buf)
        out["Poly1305 (cryptography)"] = lambda: Poly1305.generate_tag(key, buf)
    except ImportError:
        out["AES-GMAC (cryptography)"] = out["Poly1305 (cryptography)"] = None
    return out


def main(reps: int = 5) -> int:
    buf, key = os.urandom(SIZE), os.urandom(32)
    print(f"frame-MAC candidates, {SIZE >> 20} MiB buffer, best of {reps}, load {os.getloadavg()[0]:.1f}")
    for name, fn in candidates(buf, key).items():
        rate = "not installed" if fn is None else f"{best_rate(fn, reps) / 1e9:.2f} GB/s"
        print(f"  {name:<50} {rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
