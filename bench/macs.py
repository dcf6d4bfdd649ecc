"""``python -m bench.macs``: the frame-MAC candidates on this machine (one core, 4 MiB buffers, best of N).

What the frame MAC (ps/wire/auth.py) was chosen from; the optional packages are measured when installed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
import threading
import time
from typing import Callable, Dict, Optional

from paddle_cluster.ps.wire.auth import SUITES
from paddle_cluster.ps.wire.stream import SEGMENT

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


def two_threads(fn: Callable[[], object], reps: int) -> float:
    """Aggregate rate of ``fn`` run by two threads at once: 2x one thread's if it releases the GIL."""
    def both() -> None:
        ts = [threading.Thread(target=fn) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return 2 * best_rate(both, reps)


def poly1305_impls(buf: bytes, key: bytes) -> Dict[str, Optional[Callable[[], object]]]:
    """Each Poly1305 ``ps.wire.poly1305`` may use, on SEGMENT-sized pieces as a Stream feeds it."""
    from paddle_cluster.ps.wire import poly1305

    out: Dict[str, Optional[Callable[[], object]]] = {}
    mv = memoryview(buf)
    for label, make in (("libcrypto via ctypes", poly1305._libcrypto), ("cryptography", poly1305._cryptography)):
        try:
            cls = make()
        except Exception:
            out[f"Poly1305 ({label}), {SEGMENT >> 10} KiB pieces"] = None
            continue

        def run(cls=cls) -> None:
            for off in range(0, SIZE, SEGMENT):
                p = cls(key)
                p.update(mv[off:off + SEGMENT])
                p.finalize()
        out[f"Poly1305 ({label}), {SEGMENT >> 10} KiB pieces"] = run
    return out


def main(reps: int = 5) -> int:
    buf, key = os.urandom(SIZE), os.urandom(32)
    print(f"frame-MAC candidates, {SIZE >> 20} MiB buffer, best of {reps}, load {os.getloadavg()[0]:.1f}")
    for name, fn in candidates(buf, key).items():
        rate = "not installed" if fn is None else f"{best_rate(fn, reps) / 1e9:.2f} GB/s"
        print(f"  {name:<50} {rate}")
    print("Poly1305 as the frame MAC runs it: one thread / two threads at once (2x: the GIL is released)")
    for name, fn in poly1305_impls(buf, key).items():
        rate = "not available" if fn is None else \
            f"{best_rate(fn, reps) / 1e9:.2f} / {two_threads(fn, reps) / 1e9:.2f} GB/s"
        print(f"  {name:<50} {rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
