"""Files only their owner can read, for what holds the job secret on disk (an engine's plan file): the directory
checked and made private, the file created new at 0600, removed once read or the job ends. Standard library only.

``mkdir -p -m 700`` does not fix a directory that exists: a ``plans`` directory left at 0755 let another user
read a running job's secret from a file opened with the mode of whoever made it. Here an existing directory must
be a real one of this user (not a link, not another user's: refused) and is set to 0700; the file is made under
a fresh name with ``O_EXCL`` (nothing already there is written through, whatever the umask) and renamed into
place whole.
"""

from __future__ import annotations

import os
import secrets
import stat


class PrivateError(Exception):
    """A private file cannot be written safely here; the message names the path and what to fix."""


def private_dir(path: str) -> int:
    """``path`` a directory only this user can enter, opened (the fd, for the caller to close): made (its parents
    as needed), or, when it exists, checked to be a directory of this user, not a link, and set to 0700;
    ``PrivateError`` otherwise. What goes in is then made through the fd, not the name, which another user
    able to write the parent could swap after the check."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise PrivateError(f"{path} is not a directory of its own ({e.strerror}): remove it, it is made again") \
            from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PrivateError(f"{path} belongs to uid {st.st_uid}, not to uid {os.geteuid()} who runs the job: "
                               "another user could read or replace what goes in it; remove it, it is made again")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: str, data: bytes) -> None:
    """``data`` as the file ``path``, readable by this user alone from the first byte: its directory made private
    (``private_dir``), a new file at 0600 written whole, then renamed over whatever had that name."""
    name = os.path.basename(path)
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    where = private_dir(os.path.dirname(path) or ".")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=where)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=where, dst_dir_fd=where)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=where)
            except FileNotFoundError:
                pass
            raise
    finally:
        os.close(where)


def remove(path: str) -> bool:
    """``path`` gone; whether it was there."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
