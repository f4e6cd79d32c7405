"""A rollout's run folders: where they live, and which of them stepmill may change or remove.

``[run] runs_dir`` (``--runs-dir``) may name any folder, and the runner is often root: so stepmill
touches only what it made. A runs folder it made (or an empty one it was given) carries ``ROOT_MARK``;
only such a folder is opened to other users (0711) and pruned, and in it only the run folders stepmill
made (each carrying ``RUN_MARK``, or named as it names them) are ever removed. A folder that exists
without the mark and is not empty (``/tmp``, someone's data) is refused before anything runs."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from stepmill.errors import ConfigError
from stepmill.tags import encode_id

ROOT_MARK = ".stepmill-runs"  # in a runs folder stepmill made or was given empty
RUN_MARK = ".stepmill-run"  # in each run folder stepmill made
# A run folder's name: its trajectory's encoded id (80 characters at most), "-", mkdtemp's 8 characters.
RUN_NAME = re.compile(r"[A-Za-z0-9._~-]{1,80}-[a-z0-9_]{8}")


def runs_folder(db: str, runs_dir: str | None) -> Path:
    """A rollout's runs' root: ``[run] runs_dir`` (or ``--runs-dir``), else ``<database>.runs`` beside it."""
    return Path(runs_dir).expanduser().resolve() if runs_dir else Path(f"{Path(db).resolve()}.runs")


def new_runs_root(folder: Path, keep_days: float) -> Path:
    """``folder`` claimed as a runs folder (``claim_runs_root``), with run folders older than ``keep_days``
    days removed first (0: none removed)."""
    runs_root = claim_runs_root(Path(folder))
    if keep_days:
        prune_runs(runs_root, keep_days)
    return runs_root


def claim_runs_root(folder: Path) -> Path:
    """``folder`` made (or taken empty) and marked as stepmill's, then opened to other users so a user
    mode run reaches its own run folder (0711: they list none). ConfigError for anything else."""
    if not folder.exists():
        folder.mkdir(parents=True, mode=0o700)
    elif folder.is_symlink() or not folder.is_dir():
        raise ConfigError(f"[run] runs_dir (--runs-dir): {folder} is not a folder")
    elif not (folder / ROOT_MARK).is_file():
        if any(folder.iterdir()) or folder.stat().st_uid != os.geteuid():
            raise ConfigError(f"[run] runs_dir (--runs-dir): {folder} is not a stepmill runs folder (no {ROOT_MARK}) "
                              f"and is not an empty folder of this user's: stepmill removes old run folders in it, "
                              f"so name a new or empty folder")
    (folder / ROOT_MARK).touch()
    os.chmod(folder, 0o711)
    return folder


def new_run_folder(runs_root: Path, trajectory: str) -> Path:
    """A run's own folder in the runs' root, marked as stepmill's (prune_runs removes only those)."""
    run_dir = Path(tempfile.mkdtemp(prefix=encode_id(trajectory)[:80] + "-", dir=runs_root))
    (run_dir / RUN_MARK).touch()
    return run_dir


def is_run_folder(folder: Path) -> bool:
    """A folder (never a link) stepmill made for a run: its mark, or its name (a user mode run owns its
    folder and may remove the mark; only stepmill makes folders in a marked root)."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    return (folder / RUN_MARK).is_file() or RUN_NAME.fullmatch(folder.name) is not None


def prune_runs(runs_root: Path, keep_days: float) -> list[Path]:
    """Run folders that last changed (their run ended: its env file removed, its log closed) more than
    ``keep_days`` days ago are removed; a running run's folder changes as it runs. Nothing is removed
    from a folder without ``ROOT_MARK``, nor anything there that is not a run folder of stepmill's."""
    if not (runs_root / ROOT_MARK).is_file():
        return []
    cutoff = time.time() - keep_days * 86400
    removed = []
    for folder in runs_root.iterdir():
        if not is_run_folder(folder):
            continue
        log = folder / "work" / "agent.log"
        last = max(folder.lstat().st_mtime, log.lstat().st_mtime if os.path.lexists(log) else 0)
        if last < cutoff:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
