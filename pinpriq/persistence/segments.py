"""The data directory and its segment files: names, headers, the format version, the lock, and
segment files created with their space reserved.

A data directory holds::

    FORMAT                  "pinpriq log format 2\\n", written when the directory is first used
    LOCK                    locked (flock) by the one server using the directory
    0000000000000001.log    segments, numbered upwards: the log is their blocks, in order
    0000000000000002.log    ...

Format 2 (issue 21) adds the push time to copy entries (``records.py``). This version reads
format 1 too: each segment's header says which format its blocks are in, a format-1 directory's
``FORMAT`` is rewritten to 2 when a server opens it (the segments it writes are format 2, which
an older server must refuse), and no block is ever appended to a format-1 segment.

A segment is a 16-byte header (``PINPRIQL``, u32 format version, u32 CRC-32 of those 12 bytes)
followed by blocks (``records.py``) and then zero bytes up to its reserved size: a segment is
created whole, with ``posix_fallocate``, before it is needed, so that writing into it cannot
run out of disk space (``journal.py`` keeps one in reserve for that reason). A segment that has
its header and nothing else is a spare no block was ever written to.

Compiled with mypyc where it can be (``setup.py``'s list), else run as plain Python: the
compiled journal updates the active ``Segment``'s counts at every block written, which on a
native class are plain fields (~3,000 instructions a block fewer than generic attribute
operations on an interpreted one).

What this module must not know: what blocks contain, the store, trio.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import Final

__all__ = [
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "SEGMENT_HEADER_SIZE",
    "DataDir",
    "DataDirError",
    "Segment",
    "create_segment",
    "fsync_dir",
    "segment_header",
]

FORMAT_VERSION: Final = 2
#: The formats this version reads (and the one it writes).
READABLE_VERSIONS: Final = (1, 2)
FORMAT_FILE: Final = "FORMAT"
LOCK_FILE: Final = "LOCK"
_FORMAT_PREFIX: Final = "pinpriq log format "
_SEGMENT_MAGIC: Final = b"PINPRIQL"
_HEADER = struct.Struct(">8sII")  # magic, format version, CRC-32 of the 12 bytes before it
SEGMENT_HEADER_SIZE: Final = _HEADER.size
_SUFFIX: Final = ".log"
_DIGITS: Final = 16
_READ_THROUGH_CHUNK: Final = 1 << 20


class DataDirError(Exception):
    """The data directory cannot be used; the message is one line for the operator."""


def segment_header() -> bytes:
    """The 16 bytes every segment of this format version starts with."""
    head = _SEGMENT_MAGIC + FORMAT_VERSION.to_bytes(4, "big")
    return head + zlib.crc32(head).to_bytes(4, "big")


def check_segment_header(data: bytes, path: Path) -> int:
    """The format version of the segment ``data`` starts with; raises ``DataDirError`` unless
    its header is sound and this version reads that format."""
    if len(data) < _HEADER.size:
        raise DataDirError(f"{path}: {len(data)} bytes, too short for a segment header")
    magic, version, crc = _HEADER.unpack_from(data)
    if magic != _SEGMENT_MAGIC or zlib.crc32(data[:12]) != crc:
        raise DataDirError(f"{path}: not a pinpriq log segment (bad header)")
    if version not in READABLE_VERSIONS:
        raise DataDirError(
            f"{path}: written in log format {version}; this pinpriq reads formats "
            f"{' and '.join(map(str, READABLE_VERSIONS))}"
        )
    return int(version)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed or deleted files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_segment(path: Path, size: int) -> int:
    """Create a segment file of ``size`` bytes, header written and space reserved, durable
    with its directory entry; returns a descriptor open for reading and writing. Raises
    ``OSError`` (``ENOSPC`` among others) and leaves no file behind if it cannot."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, segment_header(), 0)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            # The file system cannot reserve space: writes may then meet ENOSPC themselves,
            # which the journal also handles (the reserve is then best effort).
        os.fsync(fd)
        fsync_dir(path.parent)
        _read_through(fd, size)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def _read_through(fd: int, size: int) -> None:
    """Read a new segment whole, so its pages are in the page cache before its first block
    is written. Reserved space reads as zeros with no disk I/O, but its pages exist only once
    touched: a ``pwrite`` into an untouched page allocates, charges and zeroes it first, in the
    event loop, which at -P 64 was half of the log's ``pwrite`` time (perf). Reading here, in
    the keeper's worker thread when the spare is made, does that ahead; the pages stay clean,
    so no fsync writes them back until a block is written into them, and if the kernel evicts
    them meanwhile, a write makes them again as it would have."""
    buffer = bytearray(_READ_THROUGH_CHUNK)
    for offset in range(0, size, _READ_THROUGH_CHUNK):
        if os.preadv(fd, [buffer], offset) < _READ_THROUGH_CHUNK:
            return  # the end of the file


class Segment:
    """One segment file as the journal and recovery see it, with what they count about it."""

    __slots__ = (
        "copies_at",
        "end",
        "entries",
        "entry_bytes",
        "fd",
        "first_seq",
        "live",
        "mapping",
        "number",
        "path",
        "size",
        "version",
    )

    def __init__(self, number: int, path: Path, size: int, end: int = SEGMENT_HEADER_SIZE) -> None:
        self.number = number
        self.path = path
        #: Bytes the file may hold without growing: its reserved size.
        self.size = size
        #: Bytes in use: the header and the blocks written so far.
        self.end = end
        #: A descriptor while the journal writes to or reserves this segment; else ``None``.
        self.fd: int | None = None
        #: The seq of the first push logged here (pushes are logged in seq order, so each
        #: segment holds the pushes of one range of seqs); ``None`` before its first block.
        self.first_seq: int | None = None
        #: Live packets whose latest push or copy entry is in this segment.
        self.live = 0
        #: Push and copy entries in this segment, and their bytes: their average size times
        #: ``live`` estimates the live data the segment holds.
        self.entries = 0
        self.entry_bytes = 0
        #: The log position that must be on disk before this segment may be deleted: the end of
        #: the copies compaction made of its packets (0: none made).
        self.copies_at = 0
        #: The log format its blocks are in (its header says so).
        self.version: int = FORMAT_VERSION
        #: The file mapped whole, shared, while the journal writes blocks into it by copying
        #: them there (``map``); else ``None`` (written with ``pwrite``).
        self.mapping: mmap.mmap | None = None

    def live_bytes(self) -> float:
        """An estimate of the bytes of live packet entries in this segment."""
        return self.live * self.entry_bytes / self.entries if self.entries else 0.0

    def map(self) -> bool:
        """Map the open file whole for writing, if all of its ``size`` is allocated on disk;
        whether it did. A write into a mapped page the file system has no block for (a
        sparse file, a file system that cannot reserve space) raises SIGBUS when the disk is
        full, where ``pwrite`` would say ENOSPC: such a segment is written with ``pwrite``."""
        assert self.fd is not None
        status = os.fstat(self.fd)
        if status.st_size < self.size or status.st_blocks * 512 < self.size:
            return False
        try:
            mapping = mmap.mmap(self.fd, self.size)
        except OSError:
            return False
        self.mapping = mapping
        return True

    def write(self, data: bytes | memoryview, at: int) -> int:
        """Write ``data`` at offset ``at`` of the open file: copied into the mapping if there
        is one and ``data`` ends within it, else with ``pwrite``, which may write less. A
        block running past the mapping (larger than a segment) unmaps the segment first: the
        file grows to take it. Returns the bytes written; raises ``OSError`` as ``pwrite``."""
        mapping = self.mapping
        if mapping is not None:
            end = at + len(data)
            if end <= self.size:
                mapping[at:end] = data
                return len(data)
            self.unmap()
        assert self.fd is not None
        return os.pwrite(self.fd, data, at)

    def unmap(self) -> None:
        """Stop writing through the mapping (if any): blocks are written with ``pwrite``."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None

    def close(self) -> None:
        self.unmap()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class DataDir:
    """An open data directory: its format checked and, for a server, its lock held."""

    def __init__(self, path: Path, lock_fd: int | None) -> None:
        self.path = path
        self._lock_fd = lock_fd

    @classmethod
    def open(cls, path: Path, *, write: bool) -> DataDir:
        """Open ``path`` as a data directory. With ``write``, create it if missing, write its
        FORMAT file if new, and lock it; without (an offline check), change nothing.

        Raises ``DataDirError`` with one line: not a directory, not writable, locked by another
        server, or written by a newer format version."""
        if path.exists() and not path.is_dir():
            raise DataDirError(f"data directory {path} is not a directory")
        if write:
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise DataDirError(f"cannot create data directory {path}: {_why(error)}") from None
        if not path.is_dir():
            raise DataDirError(f"data directory {path} does not exist or is not a directory")
        lock_fd = cls._lock(path) if write else None
        try:
            cls._check_format(path, write=write)
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        return cls(path, lock_fd)

    @staticmethod
    def _lock(path: Path) -> int:
        try:
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise DataDirError(f"cannot write to data directory {path}: {_why(error)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(path) from None
        return fd

    def check_startable(self) -> None:
        """Raise ``DataDirError``, with the line a start would fail with, if a server could
        not use this directory now: another server holds its lock, or the directory or a
        segment cannot be written (a read-only file system, file modes). Changes nothing: for
        ``--check-log``, whose exit status 0 means a start would succeed."""
        path = self.path
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            why = os.strerror(errno.EROFS)
        elif not os.access(path, os.W_OK):
            why = os.strerror(errno.EACCES)
        else:
            why = ""
        if why:
            raise DataDirError(f"cannot write to data directory {path}: {why}")
        for _, segment in self.segment_paths():
            if not os.access(segment, os.R_OK | os.W_OK):
                raise DataDirError(f"cannot write to {segment}: {os.strerror(errno.EACCES)}")
        try:
            fd = os.open(path / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # no server ever used it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released by the close
        except BlockingIOError:
            raise _in_use(path) from None
        finally:
            os.close(fd)

    @staticmethod
    def _check_format(path: Path, *, write: bool) -> None:
        format_file = path / FORMAT_FILE
        try:
            text = format_file.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            if any(_segment_number(p.name) is not None for p in path.iterdir()):
                raise DataDirError(
                    f"data directory {path} holds log segments but no {FORMAT_FILE} file"
                ) from None
            if write:
                _write_format(path)
            return
        version_text = text.strip().removeprefix(_FORMAT_PREFIX)
        if not text.startswith(_FORMAT_PREFIX) or not version_text.isdigit():
            raise DataDirError(f"{format_file} does not name a pinpriq log format: {text[:40]!r}")
        version = int(version_text)
        if version > FORMAT_VERSION:
            raise DataDirError(
                f"data directory {path} was written by a newer pinpriq (log format {version}); "
                f"this one reads format {FORMAT_VERSION}: upgrade pinpriq"
            )
        if version not in READABLE_VERSIONS:
            raise DataDirError(f"{format_file}: unknown log format {version}")
        if version < FORMAT_VERSION and write:  # what it writes from now on is the new format
            _write_format(path)

    def segment_paths(self) -> list[tuple[int, Path]]:
        """The segment files, oldest first, as (number, path)."""
        found = []
        for entry in self.path.iterdir():
            number = _segment_number(entry.name)
            if number is not None:
                found.append((number, entry))
        return sorted(found)

    def segment_path(self, number: int) -> Path:
        return self.path / f"{number:0{_DIGITS}d}{_SUFFIX}"

    def close(self) -> None:
        """Release the lock."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _segment_number(name: str) -> int | None:
    stem = name.removesuffix(_SUFFIX)
    if len(name) == _DIGITS + len(_SUFFIX) and stem != name and stem.isdigit():
        return int(stem)
    return None


def _write_format(path: Path) -> None:
    """Write the data directory's FORMAT file, naming the format this version writes."""
    try:
        _write_durably(path / FORMAT_FILE, f"{_FORMAT_PREFIX}{FORMAT_VERSION}\n")
    except OSError as error:
        raise DataDirError(f"cannot write to data directory {path}: {_why(error)}") from None


def _write_durably(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".new")
    with open(temporary, "w", encoding="ascii") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)


def _in_use(path: Path) -> DataDirError:
    return DataDirError(f"data directory {path} is in use by another pinpriq-server")


def _why(error: OSError) -> str:
    return error.strerror or str(error)
