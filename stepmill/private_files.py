"""Files and folders only their owner can read: everything stepmill writes holds tasks, answers and rewards."""

from __future__ import annotations

import os
from pathlib import Path


# Everything stepmill writes holds agents' tasks, answers and rewards: owner only, whatever the umask
# (the addon also runs inside a plain mitmdump, whose umask we do not choose).
def private_opener(path, flags: int) -> int:
    """For ``open(..., opener=private_opener)``: a new file is 0600; an existing one open to others becomes 0600."""
    fd = os.open(path, flags, 0o600)
    if os.fstat(fd).st_mode & 0o077:
        os.fchmod(fd, 0o600)
    return fd


def private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` and its missing parents 0700; folders that already exist are left as they are."""
    target = folder = Path(path)
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(folder, 0o700)  # the umask can only take bits away; this makes it exactly 0700
    return target
