"""Read ``torch.save`` zip files safely and lazily, without torch's unpickler.

A ``torch.save`` file is a zip archive (entries stored uncompressed) holding ``<prefix>/data.pkl``
(a pickle of the object tree) and one entry ``<prefix>/data/<key>`` per tensor storage.
:func:`open_torch_file` runs the pickle through :mod:`ucformat.sources.safe_unpickle`, which
admits only an allow-list of globals, never executes code from the file, and turns every tensor
into a :class:`TensorRef`: a description (storage, offset, shape, stride, dtype) whose bytes stay on
disk until someone reads a range of them with :meth:`TensorRef.read_into`.

So a 10 GB optimizer shard costs a few KB of memory to open, and each byte is read from disk
exactly when it is copied to its destination.

Integrity: ``data.pkl`` is read whole and checked against its zip CRC-32 by :mod:`zipfile`.
Storage bytes are checksummed as they are read (:class:`~ucformat.sources.zipcrc.MemberCrc`),
and :meth:`TorchFile.check_integrity` compares every storage member read with the CRC-32 the
archive recorded, so a bit flip in a shard file is an error, never a silently converted value.
:func:`open_embedded_torch_file` opens an archive that sits at a byte range of a larger file
(PyTorch Distributed Checkpoint ``.distcp`` files are ``torch.save`` archives back to back),
through a file descriptor the caller owns.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ucformat.errors import SourceChecksumError, TruncatedFileError, UnsupportedCheckpointError
from ucformat.format.dtypes import numpy_storage_dtype, storage_to_torch, torch_dtype
from ucformat.sources.safe_unpickle import PicklePolicy, StorageRef, load_pickle
from ucformat.sources.zipcrc import MemberCrc
from ucformat.sysio.fileio import preadv_all

if TYPE_CHECKING:  # reading a checkpoint needs no torch; only materialising a tensor does
    import torch

__all__ = ["OpenedFiles", "TensorRef", "TorchFile", "open_embedded_torch_file", "open_torch_file"]

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = b"PK\x03\x04"


@dataclass(eq=False)
class TorchFile:
    """An opened ``torch.save`` zip file: its decoded object tree and lazy storage access."""

    path: Path
    size: int
    obj: Any
    _fd: int = field(repr=False)
    _members: dict[str, zipfile.ZipInfo] = field(repr=False)
    _prefix: str = field(repr=False)
    _data_offsets: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    #: Storage key -> CRC of the pieces read so far; None: checksums are not computed.
    _crcs: dict[str, MemberCrc] | None = field(default_factory=dict, repr=False)
    #: Where the archive starts in the file (0 unless embedded), and whether ``close`` closes
    #: the descriptor (an embedded archive shares its caller's).
    _base: int = field(default=0, repr=False)
    _owns_fd: bool = field(default=True, repr=False)

    def storage_span(self, key: str) -> tuple[int, int]:
        """``(file offset, byte length)`` of storage ``key``'s bytes."""
        cached = self._data_offsets.get(key)
        if cached is not None:
            return cached
        info = self._members.get(f"{self._prefix}data/{key}")
        if info is None:
            raise TruncatedFileError(
                f"{self.path}: tensor storage '{key}' is missing from the archive; "
                "the file is damaged or truncated."
            )
        if info.compress_type != zipfile.ZIP_STORED:
            raise UnsupportedCheckpointError(
                f"{self.path}: storage '{key}' is compressed; torch.save never does that."
            )
        header = os.pread(self._fd, _LOCAL_HEADER.size, self._base + info.header_offset)
        fields = _LOCAL_HEADER.unpack(header) if len(header) == _LOCAL_HEADER.size else None
        if fields is None or fields[0] != _LOCAL_HEADER_MAGIC:
            raise TruncatedFileError(f"{self.path}: damaged zip entry for storage '{key}'.")
        name_length, extra_length = fields[9], fields[10]
        offset = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        if offset + info.file_size > self.size:
            raise TruncatedFileError(
                f"{self.path}: storage '{key}' ends at byte {offset + info.file_size} but the "
                f"file has only {self.size} bytes; the file is truncated."
            )
        span = (offset, info.file_size)
        if self._crcs is not None:
            self._crcs.setdefault(key, MemberCrc(info.file_size))
        self._data_offsets[key] = span
        return span

    def read_bytes(self, key: str, start: int, into: memoryview) -> None:
        """Fill ``into`` with the bytes of storage ``key`` from byte ``start`` on."""
        self.read_bytes_scattered(key, start, [into])

    def read_bytes_scattered(self, key: str, start: int, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in turn with consecutive bytes of storage ``key`` from ``start`` on.

        One ``preadv`` call per up to ``IOV_MAX`` views: the bytes go from the page cache
        (or the disk) straight into their destinations, e.g. the chunks of a shard buffer.
        """
        offset, length = self.storage_span(key)
        total = sum(len(view) for view in views)
        if start + total > length:
            raise TruncatedFileError(
                f"{self.path}: read of bytes [{start}, {start + total}) of storage '{key}' "
                f"overruns its {length} bytes."
            )
        if preadv_all(self._fd, views, self._base + offset + start) != total:
            raise TruncatedFileError(f"{self.path}: unexpected end of file.")
        if self._crcs is not None:
            self._crcs[key].add(start, views)

    def check_integrity(self) -> int:
        """Compare each storage member read so far with the CRC-32 the archive recorded.

        Bytes of those members that were never read (padding) are read now. Returns the number
        of members checked (0 when the file was opened with ``check_crc=False``).

        Raises:
            SourceChecksumError: a member's bytes differ from what ``torch.save`` wrote.
        """
        if self._crcs is None:
            return 0
        for key, member in sorted(self._crcs.items()):
            offset, _ = self.storage_span(key)
            name = f"{self._prefix}data/{key}"

            def read(start: int, length: int, base: int = offset) -> bytes:
                return os.pread(self._fd, length, base + start)

            try:
                found = member.value(read)
            except EOFError:
                raise TruncatedFileError(f"{self.path}: unexpected end of file.") from None
            recorded = self._members[name].CRC
            if found != recorded:
                raise SourceChecksumError(
                    f"{self.path}: zip member '{name}' (tensor storage '{key}') fails its CRC-32 "
                    f"(archive says {recorded:08x}, bytes give {found:08x}): the file was "
                    "damaged after torch.save wrote it. Restore it from a good copy, or pass "
                    "--no-check-source to use it anyway."
                )
        return len(self._crcs)

    def close(self) -> None:
        """Release the file descriptor."""
        if self._fd >= 0:
            if self._owns_fd:
                os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TorchFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, eq=False)
class TensorRef:
    """A tensor inside a :class:`TorchFile` whose bytes have not been read."""

    file: TorchFile
    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype_name(self) -> str:
        """The tensor's dtype as the manifest names it (``float32``, ``bfloat16``, ...)."""
        return self.storage.dtype_name

    @property
    def dtype(self) -> torch.dtype:
        """The tensor's torch dtype (imports torch)."""
        return torch_dtype(self.storage.dtype_name)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        """Whether the elements are one row-major run of the storage."""
        expected = 1
        for dim, step in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if dim != 1 and step != expected:
                return False
            expected *= dim
        return True

    def read_into(self, out: np.ndarray, start: int, stop: int) -> None:
        """Copy flat elements ``[start, stop)`` of this (contiguous) tensor into ``out``.

        ``out`` is a 1-D contiguous numpy array of the storage dtype (bfloat16 as uint16) and
        length ``stop - start``; the bytes go from disk straight into it.
        """
        if not self.is_contiguous():
            raise UnsupportedCheckpointError(
                f"{self.file.path}: a flat state tensor is not contiguous (stride {self.stride})."
            )
        if not 0 <= start <= stop <= self.numel:
            raise TruncatedFileError(
                f"{self.file.path}: elements [{start}, {stop}) requested from a tensor of "
                f"{self.numel} elements."
            )
        item = self.storage.itemsize
        self.file.read_bytes(self.storage.key, (self.offset + start) * item, out.data.cast("B"))

    def read_scattered(self, start: int, views: Sequence[memoryview]) -> None:
        """Copy flat elements from ``start`` on into the byte ``views``, one after another.

        Each view's length is a whole number of elements (storage dtype); together they take
        ``sum(len(v)) / itemsize`` consecutive elements of this (contiguous) tensor.
        """
        item = self.storage.itemsize
        count = sum(len(view) for view in views) // item
        if not self.is_contiguous():
            raise UnsupportedCheckpointError(
                f"{self.file.path}: a flat state tensor is not contiguous (stride {self.stride})."
            )
        if not 0 <= start <= start + count <= self.numel:
            raise TruncatedFileError(
                f"{self.file.path}: elements [{start}, {start + count}) requested from a tensor "
                f"of {self.numel} elements."
            )
        self.file.read_bytes_scattered(self.storage.key, (self.offset + start) * item, views)

    def item(self) -> bool | int | float:
        """The value of a one-element tensor as a Python scalar, exactly as ``Tensor.item()``
        gives it, without torch.

        Raises:
            ValueError: the tensor does not have exactly one element.
        """
        if self.numel != 1:
            raise ValueError(f"{self.file.path}: item() of a tensor of {self.numel} elements.")
        name = self.dtype_name
        value = np.empty(1, dtype=numpy_storage_dtype(name))
        self.file.read_bytes(self.storage.key, self.offset * self.storage.itemsize,
                             value.data.cast("B"))  # fmt: skip
        if name == "bfloat16":  # the upper half of a float32: widen the bits, exactly
            return float((value.astype(np.uint32) << 16).view(np.float32)[0])
        return value.item()  # type: ignore[no-any-return]

    def load(self) -> torch.Tensor:
        """Read the whole tensor into memory (for small tensors: buffers, scalars, metadata)."""
        import torch

        name = self.dtype_name
        if self.numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        if self.is_contiguous():
            flat = np.empty(self.numel, dtype=numpy_storage_dtype(name))
            self.read_into(flat, 0, self.numel)
            return storage_to_torch(flat, name).reshape(self.shape)
        span = self.offset + sum((d - 1) * s for d, s in zip(self.shape, self.stride, strict=True))
        whole = np.empty(span + 1, dtype=numpy_storage_dtype(name))
        self.file.read_bytes(self.storage.key, 0, whole.data.cast("B"))
        base = storage_to_torch(whole, name)
        return base.as_strided(self.shape, self.stride, self.offset).clone()


def open_torch_file(
    path: Path, policy: PicklePolicy | None = None, *, check_crc: bool = True
) -> TorchFile:
    """Open a ``torch.save`` zip file and decode its object tree with the restricted unpickler.

    Args:
        path: the file.
        policy: which pickle globals to admit beyond the allow-list.
        check_crc: checksum storage bytes as they are read, for :meth:`TorchFile.check_integrity`.

    Raises:
        TruncatedFileError: the file is not a complete zip archive or lacks ``data.pkl``.
        SourceChecksumError: ``data.pkl`` fails its CRC-32.
        UnsafePickleError: the pickle references a global outside the allow-list.
    """
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        return _open_archive(
            fd, path, 0, size, policy, owns_fd=True, what=str(path), check_crc=check_crc
        )
    except BaseException:
        os.close(fd)
        raise


def open_embedded_torch_file(
    fd: int, path: Path, offset: int, length: int, policy: PicklePolicy | None = None
) -> TorchFile:
    """Open the ``torch.save`` archive at bytes ``[offset, offset + length)`` of ``fd``.

    ``fd`` (open on ``path``) stays the caller's: closing the returned file does not close it.

    Raises:
        TruncatedFileError: the range lies past the end of the file, or holds no complete
            ``torch.save`` archive.
        UnsafePickleError: the pickle references a global outside the allow-list.
    """
    size = os.fstat(fd).st_size
    what = f"{path} (bytes {offset}-{offset + length})"
    if offset < 0 or length < 0 or offset + length > size:
        raise TruncatedFileError(
            f"{what}: the item ends at byte {offset + length} but the file has only {size} "
            "bytes; the file is truncated."
        )
    return _open_archive(fd, path, offset, length, policy, owns_fd=False, what=what)


class _Window(io.RawIOBase):
    """Bytes ``[base, base + size)`` of a file descriptor as a seekable read-only file."""

    def __init__(self, fd: int, base: int, size: int) -> None:
        self._fd, self._base, self._size, self._pos = fd, base, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        origin = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, origin + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self._size - self._pos))
        data = os.pread(self._fd, count, self._base + self._pos) if count else b""
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _open_archive(
    fd: int,
    path: Path,
    base: int,
    size: int,
    policy: PicklePolicy | None,
    *,
    owns_fd: bool,
    what: str,
    check_crc: bool = False,
) -> TorchFile:
    try:
        with zipfile.ZipFile(io.BufferedReader(_Window(fd, base, size))) as archive:
            members = {info.filename: info for info in archive.infolist()}
            pickles = [name for name in members if name.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise TruncatedFileError(
                    f"{what}: expected one '<name>/data.pkl' entry in a torch.save archive, "
                    f"found {len(pickles)}; this is not a torch checkpoint file."
                )
            prefix = pickles[0][: -len("data.pkl")]
            _check_byteorder(path, archive, members, prefix)
            payload = archive.read(pickles[0])
    except zipfile.BadZipFile as exc:
        if "CRC" in str(exc):
            raise SourceChecksumError(
                f"{path}: {exc}: the file was damaged after torch.save wrote it; restore it from "
                "a good copy."
            ) from None
        raise TruncatedFileError(
            f"{what}: not a complete zip archive ({exc}); the file is truncated, damaged, or "
            "not written by torch.save."
        ) from None
    handle = TorchFile(
        path=path,
        size=size,
        obj=None,
        _fd=fd,
        _members=members,
        _prefix=prefix,
        _crcs={} if check_crc else None,
        _base=base,
        _owns_fd=owns_fd,
    )
    # A refused pickle raises here; the caller owns (and closes) the descriptor either way.
    handle.obj = load_pickle(
        payload,
        source=what,
        policy=policy or PicklePolicy(),
        make_tensor=lambda storage, offset, shape, stride: TensorRef(
            handle, storage, offset, shape, stride
        ),
    )
    return handle


def _check_byteorder(
    path: Path, archive: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo], prefix: str
) -> None:
    name = f"{prefix}byteorder"
    if name in members and archive.read(name).strip() not in (b"little", b""):
        raise UnsupportedCheckpointError(
            f"{path}: big-endian torch files are not supported (byteorder "
            f"{archive.read(name).decode(errors='replace')!r})."
        )


class OpenedFiles:
    """The torch files one reader opens, closed together (the reader's ``close`` on failure).

    >>> files = OpenedFiles(None, check_crc=False)
    >>> files.handles, files.close()
    ([], None)
    """

    def __init__(self, policy: PicklePolicy | None, *, check_crc: bool) -> None:
        self.policy = policy
        self.check_crc = check_crc
        #: Every file opened so far, in order.
        self.handles: list[TorchFile] = []

    def open(self, path: Path) -> TorchFile:
        """Open ``path`` as :func:`open_torch_file` does and keep its handle."""
        handle = open_torch_file(path, self.policy, check_crc=self.check_crc)
        self.handles.append(handle)
        return handle

    def close(self) -> None:
        """Close every file opened so far."""
        for handle in self.handles:
            handle.close()
