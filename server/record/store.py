"""The incident ring: one file per incident in ``--incident-dir``, bounded.

Capped by count, total bytes, bytes per incident and age; the oldest go
first. A file is written under a temporary name and renamed into place, so a
crash leaves either the whole incident or none. Its layout::

    MAGIC (8) | u32 head length | u32 crc32(head) | head
    | u32 crc32(tensors) | tensors: per tensor, u32 header length, header
      (CaptureHeader proto), then header.total_bytes raw bytes
    head: u32 owner length | owner (UTF-8) | record (Incident proto)

The owner is the principal that owned the tap whose trigger fired (``""`` for
the server's own taps); it lives in the file, not in the ``Incident`` message,
so it survives a restart and is never sent to clients. Files of the first
layout (``MAGIC_V1``, head = the record alone) predate owners and load as the
server's: only ``admin`` sees them.

The index (every file's record) is read at start; a file that cannot be read
is skipped and counted. Tensor bytes are read only by :meth:`IncidentStore.read`,
which checks their CRC first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from google.protobuf.message import DecodeError

from layertap.server.errors import InvalidField, NotFound
from layertap.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

MAGIC = b"LTINC002"
#: Files written before incidents had owners (no owner in the head).
MAGIC_V1 = b"LTINC001"
SUFFIX = ".incident"
ID_PATTERN = re.compile(r"inc-[0-9]{13}-[0-9a-f]{8}")
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class RingLimits:
    """The ring's bounds (``--incident-*`` flags)."""

    max_count: int = 100
    max_bytes: int = 1 << 30
    max_incident_bytes: int = 64 << 20
    max_age_seconds: float = 7 * 86400.0


@dataclass
class StoredTensor:
    header: pb.CaptureHeader
    data: bytes


def new_id(now: float) -> str:
    return f"inc-{int(now * 1000):013d}-{secrets.token_hex(4)}"


def check_id(incident_id: str, field: str = "id") -> None:
    if not ID_PATTERN.fullmatch(incident_id):
        raise InvalidField(field, "expected an incident id such as inc-1700000000000-0123abcd (see ListIncidents)")


def _head(record: pb.Incident, owner: bytes) -> bytes:
    return _U32.pack(len(owner)) + owner + record.SerializeToString()


def encode(record: pb.Incident, tensors: list[StoredTensor], owner: str = "") -> bytes:
    """The file's bytes (``record.bytes`` is filled in here)."""
    body = b"".join(_U32.pack(len(h := t.header.SerializeToString())) + h + t.data for t in tensors)
    who = owner.encode()
    record.tensor_count = len(tensors)
    record.bytes = 0
    head_len = len(_head(record, who))
    # The size field's own varint length can change the total; settle it.
    for _ in range(3):
        record.bytes = len(MAGIC) + 8 + head_len + 4 + len(body)
        head_len = len(_head(record, who))
    head = _head(record, who)
    return MAGIC + _U32.pack(len(head)) + _U32.pack(zlib.crc32(head)) + head + _U32.pack(zlib.crc32(body)) + body


def fit(record: pb.Incident, tensors: list[StoredTensor], max_bytes: int, owner: str = "") -> int:
    """How many leading ``tensors`` fit a file of ``max_bytes`` (one pass over the sizes)."""
    probe = pb.Incident()
    probe.CopyFrom(record)
    # The record's counters at their widest: the head can only be smaller.
    probe.tensor_count = probe.tensors_dropped = len(tensors) + record.tensors_dropped
    probe.bytes = max_bytes
    room = max_bytes - len(MAGIC) - 8 - len(_head(probe, owner.encode())) - 4
    for n, t in enumerate(tensors):
        room -= 4 + t.header.ByteSize() + len(t.data)
        if room < 0:
            return n
    return len(tensors)


def _exactly(fh: BinaryIO, n: int) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise ValueError(f"truncated: {len(data)} of {n} bytes")
    return data


def _read_record(fh: BinaryIO) -> tuple[pb.Incident, str]:
    """The record and owner at the start of an open file, leaving ``fh`` where its tensors begin.

    Raises:
        ValueError: Not an incident file, truncated or corrupt.
    """
    prefix = _exactly(fh, 16)
    if prefix[:8] not in (MAGIC, MAGIC_V1):
        raise ValueError("not an incident file (bad magic)")
    (n,), (crc,) = _U32.unpack(prefix[8:12]), _U32.unpack(prefix[12:16])
    head = fh.read(n)
    if len(head) != n or zlib.crc32(head) != crc:
        raise ValueError("record truncated or corrupt (CRC mismatch)")
    owner = ""
    if prefix[:8] == MAGIC:
        if n < 4 or 4 + (k := _U32.unpack_from(head)[0]) > n:
            raise ValueError("the owner runs past the record")
        owner, head = head[4:4 + k].decode("utf-8"), head[4 + k:]  # UnicodeDecodeError is a ValueError
    try:
        rec = pb.Incident.FromString(head)
    except DecodeError as exc:
        raise ValueError(f"record does not decode: {exc}") from None
    if not ID_PATTERN.fullmatch(rec.id):
        raise ValueError(f"bad incident id {rec.id[:40]!r}")
    return rec, owner


def _decode_tensors(body: bytes) -> list[StoredTensor]:
    out, pos = [], 0
    while pos < len(body):
        if pos + 4 > len(body):
            raise ValueError("tensor section truncated")
        (n,) = _U32.unpack_from(body, pos)
        if pos + 4 + n > len(body):
            raise ValueError("tensor header truncated")
        header = pb.CaptureHeader.FromString(body[pos + 4: pos + 4 + n])
        pos += 4 + n
        out.append(StoredTensor(header, body[pos: pos + header.total_bytes]))
        pos += header.total_bytes
    if pos != len(body):
        raise ValueError("tensor section does not add up")
    return out


class IncidentStore:
    """The ring in one directory; thread-safe."""

    def __init__(self, directory: str | Path, limits: RingLimits = RingLimits(), *,
                 clock: Callable[[], float] = time.time) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._index: dict[str, pb.Incident] = {}
        #: Incident id -> its owner (see the module docstring).
        self._owners: dict[str, str] = {}
        #: Files that could not be read since start (corrupt, truncated, foreign).
        self.skipped_files = 0
        self._load()

    def _path(self, incident_id: str) -> Path:
        return self.dir / f"{incident_id}{SUFFIX}"

    def _load(self) -> None:
        for tmp in self.dir.glob(f".*{SUFFIX}.tmp"):
            tmp.unlink(missing_ok=True)  # a write that a crash cut short
        for path in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                with open(path, "rb") as fh:
                    rec, owner = _read_record(fh)
                    size = os.fstat(fh.fileno()).st_size
                if path.name != f"{rec.id}{SUFFIX}":
                    raise ValueError("file name does not match its incident id")
                if size != rec.bytes:  # the body's CRC is read only on a read; a cut file shows here
                    raise ValueError(f"the file has {size} bytes, its record says {rec.bytes} (truncated or appended to)")
            except (OSError, ValueError, Exception) as exc:  # noqa: BLE001 - DecodeError too
                self.skipped_files += 1
                log.warning("incident file %s skipped: %s", path.name, exc)
                continue
            self._index[rec.id] = rec
            self._owners[rec.id] = owner
        with self._lock:
            self._evict(0)
        log.info("incident ring %s: %d incidents loaded, %d files skipped", self.dir, len(self._index), self.skipped_files)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(r.bytes for r in self._index.values())

    def write(self, record: pb.Incident, tensors: list[StoredTensor], owner: str = "") -> pb.Incident:
        """Store ``owner``'s incident, dropping tensors from the end to fit the per-incident cap.

        The cut is computed from the sizes, then the file is encoded once:
        re-encoding per dropped tensor was quadratic in the incident's size.
        """
        kept = tensors[:fit(record, tensors, self.limits.max_incident_bytes, owner)]
        record.tensors_dropped += len(tensors) - len(kept)
        data = encode(record, kept, owner)
        path = self._path(record.id)
        tmp = self.dir / f".{record.id}{SUFFIX}.tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            # A partial file on a full disk would keep it full until the next start.
            with contextlib.suppress(OSError):  # never hide the write's own error
                tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._index[record.id] = record
            self._owners[record.id] = owner
            self._evict(0)
        return record

    def _forget(self, incident_id: str) -> pb.Incident | None:
        """Drop an incident from the index (caller holds the lock); its record, or None."""
        self._owners.pop(incident_id, None)
        return self._index.pop(incident_id, None)

    def _evict(self, _reserve: int) -> None:
        """Drop the oldest until every bound holds (caller holds the lock)."""
        cutoff = self._clock() - self.limits.max_age_seconds
        order = sorted(self._index.values(), key=lambda r: (r.time.ToNanoseconds(), r.id))
        total = sum(r.bytes for r in order)
        for rec in order:
            over = (len(self._index) > self.limits.max_count or total > self.limits.max_bytes
                    or rec.time.ToNanoseconds() / 1e9 < cutoff)
            if not over:
                continue
            self._forget(rec.id)
            total -= rec.bytes
            self._path(rec.id).unlink(missing_ok=True)
            log.info("incident %s evicted from the ring", rec.id)

    def entries(self, tap: str = "", owner: str | None = None) -> list[pb.Incident]:
        """Newest first; only ``owner``'s unless it is None."""
        with self._lock:
            self._evict(0)
            recs = [r for r in self._index.values()
                    if (not tap or r.tap == tap) and (owner is None or self._owners.get(r.id, "") == owner)]
        return sorted(recs, key=lambda r: (r.time.ToNanoseconds(), r.id), reverse=True)

    def get(self, incident_id: str) -> pb.Incident:
        check_id(incident_id)
        with self._lock:
            self._evict(0)
            rec = self._index.get(incident_id)
        if rec is None:
            raise NotFound(f"no incident {incident_id}; list them with ListIncidents", field="id")
        return rec

    def owner_of(self, incident_id: str) -> str:
        """The principal an incident belongs to (``""``: the server's, or written before owners).

        Raises:
            InvalidField: Not an incident id.
            NotFound: No such incident.
        """
        check_id(incident_id)
        with self._lock:
            self._evict(0)
            owner = self._owners.get(incident_id)  # set and dropped with the index entry
        if owner is None:
            raise NotFound(f"no incident {incident_id}; list them with ListIncidents", field="id")
        return owner

    def read(self, incident_id: str) -> tuple[pb.Incident, list[StoredTensor]]:
        """The record and its tensors, CRC-checked, from one open of the file.

        One handle: a delete or eviction between two opens would have looked
        like a corrupt file. A file gone since the index said so is NOT_FOUND
        and not counted; an unreadable one is dropped from the index and counted.
        """
        self.get(incident_id)
        try:
            with open(self._path(incident_id), "rb") as fh:
                rec, _owner = _read_record(fh)
                (crc,) = _U32.unpack(_exactly(fh, 4))
                body = fh.read()
            if zlib.crc32(body) != crc:
                raise ValueError("tensor section corrupt (CRC mismatch)")
            return rec, _decode_tensors(body)
        except FileNotFoundError:
            with self._lock:
                self._forget(incident_id)
            raise NotFound(f"no incident {incident_id}: it was deleted or evicted", field="id") from None
        except (OSError, ValueError, struct.error, DecodeError) as exc:
            with self._lock:
                self._forget(incident_id)
                self.skipped_files += 1
            raise NotFound(f"incident {incident_id} is unreadable and was dropped from the index: {exc}",
                           field="id") from None

    def delete(self, incident_id: str) -> None:
        check_id(incident_id)
        with self._lock:
            rec = self._forget(incident_id)
        if rec is None:
            raise NotFound(f"no incident {incident_id}; list them with ListIncidents", field="id")
        self._path(incident_id).unlink(missing_ok=True)
