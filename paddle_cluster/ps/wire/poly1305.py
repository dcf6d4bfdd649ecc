"""Poly1305 (RFC 8439) for the frame MAC: ``Poly1305(key)``, ``update(data)``, ``finalize() -> 16 bytes``.

Preferred: the system's OpenSSL 3 ``libcrypto`` through ctypes, which releases the GIL for the call, so two
connection threads of one process hash on two cores (the ``cryptography`` package's Poly1305 holds the GIL:
two threads take twice as long as one). Else ``cryptography``'s. Both give the same tags (the wire does not
change) and are checked against RFC 8439's test vector before use; ``Poly1305`` is None when neither works.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any, Optional

import numpy as np

# RFC 8439, 2.5.2
_KEY = bytes.fromhex("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b")
_MSG = b"Cryptographic Forum Research Group"
_TAG = bytes.fromhex("a8061dc1305136c6c22b8baf0c0127a9")


def _libcrypto() -> Any:
    """A ``Poly1305`` class over libcrypto's EVP_MAC (OpenSSL 3), or raises."""
    try:  # by its OpenSSL 3 soname first: find_library runs ldconfig, ~12-30 ms in every pserver and trainer
        lib = ctypes.CDLL("libcrypto.so.3")
    except OSError:
        lib = ctypes.CDLL(ctypes.util.find_library("crypto") or "libcrypto.so.3")
    vp, size = ctypes.c_void_p, ctypes.c_size_t
    lib.EVP_MAC_fetch.restype = vp
    lib.EVP_MAC_fetch.argtypes = [vp, ctypes.c_char_p, ctypes.c_char_p]
    lib.EVP_MAC_CTX_new.restype = vp
    lib.EVP_MAC_CTX_new.argtypes = [vp]
    lib.EVP_MAC_CTX_free.argtypes = [vp]
    lib.EVP_MAC_init.argtypes = [vp, ctypes.c_char_p, size, vp]
    lib.EVP_MAC_update.argtypes = [vp, vp, size]
    lib.EVP_MAC_final.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(size), size]
    mac = lib.EVP_MAC_fetch(None, b"POLY1305", None)
    if not mac:
        raise OSError("libcrypto has no POLY1305")

    class Poly1305:
        def __init__(self, key: bytes) -> None:
            self._ctx = lib.EVP_MAC_CTX_new(mac)
            if not self._ctx or lib.EVP_MAC_init(self._ctx, bytes(key), len(key), None) != 1:
                raise ValueError("EVP_MAC_init(POLY1305) failed")

        def update(self, data: Any) -> None:
            a = np.frombuffer(data, np.uint8)
            if a.nbytes and lib.EVP_MAC_update(self._ctx, a.ctypes.data, a.nbytes) != 1:
                raise ValueError("EVP_MAC_update(POLY1305) failed")

        def finalize(self) -> bytes:
            out, n = ctypes.create_string_buffer(16), size()
            ok = lib.EVP_MAC_final(self._ctx, out, ctypes.byref(n), 16)
            lib.EVP_MAC_CTX_free(self._ctx)
            self._ctx = None
            if ok != 1 or n.value != 16:
                raise ValueError("EVP_MAC_final(POLY1305) failed")
            return out.raw

        def __del__(self) -> None:
            if self._ctx:
                lib.EVP_MAC_CTX_free(self._ctx)

    return Poly1305


def _cryptography() -> Any:
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    return Poly1305


def _first_working() -> Optional[Any]:
    for make in (_libcrypto, _cryptography):
        try:
            cls = make()
            p = cls(_KEY)
            p.update(memoryview(_MSG))
            if p.finalize() == _TAG:  # a FIPS-only OpenSSL refuses Poly1305: then it is not offered
                return cls
        except Exception:  # not installed, too old, or unusable
            continue
    return None


Poly1305 = _first_working()
