"""Making written files durable: ``fsync_file`` (a file's data and size), ``fsync_dir`` (a
directory's entries: what a rename or a new file changed) and ``write_atomic`` (a small text file
replaced whole). Checkpoints and HF exports call them
before a final name points at their data, so a machine crash never leaves a final name over data
that never reached the disk."""

from __future__ import annotations

import os
import uuid


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync a directory; a no-op where it cannot be opened or the filesystem refuses fsync on
    directories (some network filesystems)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Write a small text file so readers see the old or the new content, never a mix (a temporary
    file fsynced, renamed over ``path``, the directory fsynced)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
