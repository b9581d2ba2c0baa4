"""Files appear whole or not at all: written to a temp file beside them, then renamed."""

from __future__ import annotations

import os
import tempfile


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically; a missing folder is a FileNotFoundError."""
    write_bytes(path, text.encode())


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; a missing folder is a FileNotFoundError."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path!r}: folder {folder!r} does not exist")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".amp-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
