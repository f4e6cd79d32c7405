"""Off the event loop: the append-only journal between the proxy and the database, appended by the
handoff thread and read back by the writer.

A finished call is appended here (a few system calls, into the OS page cache) before anything
tries SQLite, so a locked database, a full disk or a kill -9 of the proxy never loses it: the
writer commits entries to SQLite in batches and records how far it got *in the same
transaction*, and whatever is past that position is replayed by the next writer.

Layout: ``<db>.journal/<id>/`` per writer, holding ``lock`` (flocked while a writer owns the
journal) and segments ``00000001.seg``, …; folders 0700, files 0600 (the owner's only). An entry
is ``length u32 | crc32 u32 | payload``; a torn last entry (the process died mid-append) fails
its length or CRC check and is ignored.
The payload is a small JSON header and raw byte blobs, so appending a 50 MB body costs a
memory copy, not a serialisation.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from stepmill.private_files import private_dir, private_opener

_HEAD = struct.Struct("<II")  # length of payload, crc32 of payload
_U32 = struct.Struct("<I")
SEGMENT_BYTES = 16 * 1024 * 1024  # a new segment starts after this much


def entry_parts(header: dict, blobs: list) -> list:
    """One entry as a list of buffers (a 50 MB body is written as it is, never copied into a join).
    header: JSON-able; blobs: raw bytes, referenced from the header by index."""
    head = json.dumps(header, separators=(",", ":")).encode("utf-8", "surrogatepass")
    parts = [_U32.pack(len(head)), head, _U32.pack(len(blobs))]
    for blob in blobs:
        parts += [_U32.pack(len(blob)), blob]
    crc, length = 0, 0
    for part in parts:
        crc = zlib.crc32(part, crc)
        length += len(part)
    return [_HEAD.pack(length, crc), *parts]


def encode_entry(header: dict, blobs: list) -> bytes:
    return b"".join(entry_parts(header, blobs))


def decode_entry(payload: bytes | memoryview) -> tuple[dict, list[bytes]]:
    view = memoryview(payload)
    (head_len,) = _U32.unpack_from(view, 0)
    header = json.loads(bytes(view[4:4 + head_len]).decode("utf-8", "surrogatepass"))
    pos = 4 + head_len
    (count,) = _U32.unpack_from(view, pos)
    pos += 4
    blobs = []
    for _ in range(count):
        (size,) = _U32.unpack_from(view, pos)
        blobs.append(bytes(view[pos + 4: pos + 4 + size]))
        pos += 4 + size
    return header, blobs


@dataclass(frozen=True, order=True)
class Position:
    segment: int
    offset: int

    def __str__(self) -> str:
        return f"{self.segment}:{self.offset}"

    @classmethod
    def parse(cls, text: str | None) -> "Position":
        if not text:
            return cls(1, 0)
        segment, _, offset = text.partition(":")
        return cls(int(segment), int(offset))


def journal_root(db_path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(db_path)}.journal")


UNREADABLE_KEY = "calls_unreadable"  # in the store's state table: calls the writers kept as error steps, unread


def entry_identity(journal_id: str, end: Position) -> str:
    """An entry's identity, which the store keeps unique (store/entries.py): its journal and where it ends
    there. Only that entry ever lies there, and a replay reads it there again, header readable or not."""
    return f"{journal_id}:{end}"


def state_key(journal_id: str) -> str:
    """Where a journal's committed position lives in the store's ``state`` table."""
    return f"journal:{journal_id}"


class Journal:
    """One writer's journal: appended by the proxy, read back and committed by the writer."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.id = folder.name
        self._lock_file = None
        self._append = None
        self._segment = 0
        self._end = 0  # where the open segment ends: this journal's appends are the only ones to it
        self._reader: tuple[int, int] | None = None  # (segment, fd) the writer read last: kept open between reads
        self._dropped_below = 0  # segments under this number are dropped already

    @classmethod
    def create(cls, db_path) -> "Journal":
        """A new journal, locked before it becomes visible (a writer looking for orphans must never
        take a journal whose owner is still setting it up)."""
        name = uuid.uuid4().hex[:16]
        root = private_dir(journal_root(db_path))
        if root.stat().st_mode & 0o077:
            root.chmod(0o700)  # made by an older stepmill: calls in it are no one else's to read
        hidden = root / f".{name}.new"
        hidden.mkdir(mode=0o700)
        journal = cls(hidden)
        if not journal.try_lock(shared=True):
            raise RuntimeError(f"could not lock the new journal {hidden}")
        hidden.rename(hidden.with_name(name))  # the lock's open file moves with the folder
        journal.folder, journal.id = hidden.with_name(name), name
        return journal

    @classmethod
    def orphans(cls, db_path) -> list["Journal"]:
        """Journals whose writer is gone (their lock is free): the next writer replays them."""
        root = journal_root(db_path)
        found = []
        for folder in sorted(root.iterdir()) if root.exists() else []:
            if not folder.is_dir() or folder.name.startswith("."):
                continue
            journal = cls(folder)
            if journal.try_lock():
                found.append(journal)
        return found

    # -- ownership ----------------------------------------------------------------------
    def try_lock(self, *, shared: bool = False) -> bool:
        """Owners (the proxy appending, its writer committing) hold the lock shared; a journal whose
        lock can be taken exclusively has no owner left: it is an orphan to replay."""
        handle = open(self.folder / "lock", "a+b", opener=private_opener)
        try:
            fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return False
        self._lock_file = handle
        return True

    def release(self) -> None:
        self._close_reader()
        if self._append is not None:
            self._append.close()
            self._append = None
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    @property
    def status_path(self) -> Path:
        """Where the writer process of this journal says why it is behind (``writer.ProcessWriter.status``)."""
        return self.folder / "writer-status.json"

    def remove(self) -> None:
        """Delete a fully committed journal (its lock is released last)."""
        for path in self.segments():
            path.unlink(missing_ok=True)
        self.status_path.unlink(missing_ok=True)
        (self.folder / "lock").unlink(missing_ok=True)
        self.release()
        try:
            self.folder.rmdir()
        except OSError:
            pass

    # -- appending ----------------------------------------------------------------------
    def segments(self) -> list[Path]:
        try:  # os.scandir: the writer lists them twice per batch, and pathlib's glob is slow at it
            names = sorted(entry.name for entry in os.scandir(self.folder) if entry.name.endswith(".seg"))
        except FileNotFoundError:
            return []
        return [self.folder / name for name in names]

    def _segment_path(self, number: int) -> Path:
        return self.folder / f"{number:08d}.seg"

    def append(self, entry: bytes | list) -> Position:
        """Append encoded entries (bytes, or a list of buffers written with writev); returns where the
        next entry starts. OSError when the disk refuses."""
        if self._append is None or self._end >= SEGMENT_BYTES:
            if self._append is None:  # each opening starts a new segment: a crash's torn tail stays at an end
                existing = self.segments()
                number = int(existing[-1].stem) + 1 if existing else 1
            else:
                self._append.close()
                self._append, number = None, self._segment + 1
            # The number is taken only once its file opened: a refused open retried never skips one.
            self._append = open(self._segment_path(number), "ab", buffering=0, opener=private_opener)
            self._segment = number
            self._end = os.fstat(self._append.fileno()).st_size
        # The end is counted here, not asked of the file: each lseek would let go of the GIL, and the event
        # loop, running meanwhile, would make this thread wait for it back.
        start = self._end
        parts = [entry] if isinstance(entry, (bytes, bytearray, memoryview)) else list(entry)
        try:
            fd = self._append.fileno()
            for i in range(0, len(parts), 512):  # within IOV_MAX
                chunk = parts[i:i + 512]
                size = sum(len(p) for p in chunk)
                written = os.writev(fd, chunk)
                rest = memoryview(b"".join(chunk))[written:] if written < size else b""
                while rest:  # a short write: the rest, once joined
                    more = os.write(fd, rest)
                    if not more:
                        raise OSError("the journal took no more bytes")
                    rest = rest[more:]
                self._end += size
        except OSError:
            self._end = start
            self._append.truncate(start)  # never leave half an entry before the next one
            raise
        return Position(self._segment, self._end)

    # -- reading ------------------------------------------------------------------------
    def read(self, after: Position, max_bytes: int = 8 * 1024 * 1024) -> Iterator[tuple[Position, bytes]]:
        """Entries after ``after``, each with the position just past it; stops at a torn or missing tail."""
        total = 0
        for number in self._segments_from(after.segment):
            offset = after.offset if number == after.segment else 0
            fd = self._reader_fd(number)
            if fd is None:
                continue
            while True:
                # pread, unbuffered: a tail torn by a refused append is rewritten in place, never served stale
                head = os.pread(fd, _HEAD.size, offset)
                if len(head) < _HEAD.size:
                    break
                length, crc = _HEAD.unpack(head)
                payload = os.pread(fd, length, offset + _HEAD.size)
                if len(payload) < length or zlib.crc32(payload) != crc:
                    break  # torn by a crash mid-append, or still being written
                offset += _HEAD.size + length
                yield Position(number, offset), payload
                total += length
                if total >= max_bytes:
                    return

    def _segments_from(self, first: int) -> Iterator[int]:
        """Segment numbers from ``first`` on. While the writer keeps up, the segment it has open is the
        last one, and one stat of the next name says so: no listing of the folder per read. The next is
        looked for *before* the open one is read: once it exists, the open one takes no more appends."""
        if self._reader is not None and self._reader[0] == first:
            later = os.path.exists(self._segment_path(first + 1))
            yield first
            if not later:
                return
            first += 1
        for path in self.segments():
            if int(path.stem) >= first:
                yield int(path.stem)

    def _reader_fd(self, number: int) -> int | None:
        """The open segment ``number`` (the one before it closed), or None if it is gone."""
        if self._reader is not None and self._reader[0] == number:
            return self._reader[1]
        self._close_reader()
        try:
            self._reader = (number, os.open(self._segment_path(number), os.O_RDONLY | os.O_CLOEXEC))
        except FileNotFoundError:
            return None
        return self._reader[1]

    def _close_reader(self) -> None:
        if self._reader is not None:
            os.close(self._reader[1])
            self._reader = None

    def backlog(self, after: Position) -> int:
        """Bytes appended but not committed."""
        size = 0
        for path in self.segments():
            number = int(path.stem)
            if number > after.segment:
                size += path.stat().st_size
            elif number == after.segment:
                size += max(0, path.stat().st_size - after.offset)
        return size

    def end(self) -> Position:
        """Where the appends end now (the last segment's size): what a barrier waits to see committed."""
        segments = self.segments()
        if not segments:
            return Position(1, 0)
        return Position(int(segments[-1].stem), segments[-1].stat().st_size)

    def committed(self, store) -> Position:
        """How far the writer committed this journal (kept in ``store``'s state table)."""
        return Position.parse(store.get_state(state_key(self.id)))

    def retire(self, store) -> bool:
        """Remove this journal, then its position and its entries' identities, if everything in it is
        committed; False if not. The files go first: a writer that dies in between leaves a position and
        identities of a journal no one can read again (``forget_removed`` clears them), never segments
        whose identities are gone, which the next writer would commit again."""
        if self.backlog(self.committed(store)):
            return False
        self.remove()
        store.set_state(state_key(self.id), None)
        store.forget_journal(self.id)
        return True

    def drop_before(self, position: Position) -> None:
        """Segments wholly before the committed position are no longer needed (the folder is listed
        only when the position reached a segment it had not)."""
        if position.segment <= self._dropped_below:
            return
        for path in self.segments():
            if int(path.stem) < position.segment and int(path.stem) != self._segment:
                path.unlink(missing_ok=True)
        self._dropped_below = position.segment


def forget_removed(store) -> None:
    """The positions and entry identities of journals whose folders are gone (a retire cut short after
    its files went): nothing of them can be read again."""
    root = journal_root(store.path)
    for key in store.journal_positions():
        journal_id = key.removeprefix(state_key(""))
        if not (root / journal_id).exists():
            store.set_state(key, None)
            store.forget_journal(journal_id)


def stats_with_backlog(store) -> dict:
    """``store.stats()`` with what its journals hold beyond the committed positions (`stepmill stats`, /v1/stats).
    The journals are the pipeline's files beside the database; the store knows only their positions."""
    return {**store.stats(), "journal": backlog(store.path, store.journal_positions()),
            "unreadable_calls": int(store.get_state(UNREADABLE_KEY) or 0)}


def backlog(db_path, positions: dict[str, str]) -> dict:
    """What every journal of a database holds beyond its committed position."""
    root = journal_root(db_path)
    journals, pending = 0, 0
    for folder in sorted(root.iterdir()) if root.exists() else []:
        if folder.is_dir():
            journals += 1
            pending += Journal(folder).backlog(Position.parse(positions.get(state_key(folder.name))))
    return {"journals": journals, "uncommitted_bytes": pending}
