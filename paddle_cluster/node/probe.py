"""What a node offers a job: its interfaces and the NIC's address, free ports, Python, numpy, ROOT_DIR."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import socket
import struct
import sys
from typing import Any, Dict, Optional, Sequence


def interfaces() -> Dict[str, Optional[str]]:
    """Every network interface and its IPv4 address (None when it has none)."""
    out: Dict[str, Optional[str]] = {}
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                out[name] = socket.inet_ntoa(packed[20:24])
            except OSError:
                out[name] = None
    finally:
        s.close()
    return out


def network(nic: str) -> Optional[str]:
    """The IPv4 network of ``nic`` as CIDR (``10.0.0.0/24``), or None: what names the same wire from a
    machine where the interface has another name (mpirun's own wiring, from the launcher's machine)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = struct.pack("256s", nic.encode()[:15])
        addr = fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]  # SIOCGIFADDR
        mask = fcntl.ioctl(s.fileno(), 0x891B, req)[20:24]  # SIOCGIFNETMASK
    except OSError:
        return None
    finally:
        s.close()
    net = bytes(a & b for a, b in zip(addr, mask))
    return f"{socket.inet_ntoa(net)}/{bin(int.from_bytes(mask, 'big')).count('1')}"


def port_free(addr: str, port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _root(path: str) -> Dict[str, Any]:
    root: Dict[str, Any] = {"path": path}
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
        root["writable"] = True
        root["free_bytes"] = shutil.disk_usage(path).free
    except OSError as e:
        root["writable"] = False
        root["error"] = f"{e.strerror or e}"
    return root


def machine_id() -> str:
    """This machine's id (a hash of /etc/machine-id, or of the hostname without one): two HOSTS entries that
    answer with the same id and address are the same machine. Containers and namespaces may share the file,
    so the launcher pairs it with the NIC's address."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path, "rb") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return hashlib.sha256(b"paddle-cluster machine|" + text).hexdigest()[:16]
    return hashlib.sha256(b"paddle-cluster host|" + socket.gethostname().encode()).hexdigest()[:16]


def numpy_version() -> Optional[str]:
    """numpy's version as installed (its ``version.py``), without importing it: that alone would cost every
    node ~0.2 s of CPU per job. "unknown" when the file does not say; None when numpy is missing."""
    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
            found = re.search(r"^(?:full_)?version\s*=\s*['\"]([^'\"]+)", f.read(), re.M)
    except OSError:
        found = None
    return found.group(1) if found else "unknown"


FRAMEWORKS = {"torch": "torch", "paddle": "paddlepaddle"}  # module -> its distribution (pip's name)


def frameworks() -> Dict[str, Optional[str]]:
    """Each framework a script may import (``FRAMEWORKS``): its version as installed, "unknown" when its
    distribution does not say, None when this interpreter cannot import it; found, never imported."""
    out: Dict[str, Optional[str]] = {}
    for module, dist in FRAMEWORKS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        version = None
        if found:
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                version = "unknown"
        out[module] = version
    return out


def probe(nic: str, ports: Sequence[int], root: str) -> Dict[str, Any]:
    """The node's answer to the launcher's preflight, as one JSON-ready document."""
    ifaces = interfaces()
    addr = ifaces.get(nic)
    return {
        "hostname": socket.gethostname(),
        "machine": machine_id(),
        "python": sys.version.split()[0],
        "python_path": sys.executable,
        "numpy": numpy_version(),
        "frameworks": frameworks(),
        "nic": nic,
        "address": addr,
        "network": network(nic) if addr else None,
        "interfaces": ifaces,
        "ports_taken": [p for p in ports if addr and not port_free(addr, p)],
        "root": _root(root),
    }
