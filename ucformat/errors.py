"""The one error hierarchy of ucformat.

Every error a user can cause derives from :class:`UCFormatError`. Messages are part of the API:
each says what was expected, what was found, and what to do, on a single line, so that the CLI
can print ``error: <message>`` and exit with code 2.

Dual inheritance follows zarr's ``errors.py``: callers may catch either the ucformat class or the
matching builtin (``KeyError``, ``FileNotFoundError``).
"""

from __future__ import annotations

__all__ = [
    "ChunkMissingError",
    "CollectiveError",
    "CorruptDataError",
    "CoverageError",
    "DistributedWriteError",
    "IncompleteStoreError",
    "InvalidNameError",
    "LayoutMismatchError",
    "ManifestError",
    "LoadAbortedError",
    "ModelMismatchError",
    "NotACheckpointError",
    "NotAStoreError",
    "OutOfRangeError",
    "ParamNotFoundError",
    "SourceChecksumError",
    "SaveAbortedError",
    "SourceNotFoundError",
    "StoreAccessError",
    "StoreBusyError",
    "StoreExistsError",
    "StoreWriteError",
    "TruncatedFileError",
    "UCFormatError",
    "UnsafePickleError",
    "UnsupportedCheckpointError",
    "UnsupportedExportError",
    "UnsupportedVersionError",
]


class UCFormatError(ValueError):
    """Base class of every error ucformat raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))

    @property
    def message(self) -> str:
        """The one-line message."""
        return str(self.args[0])

    def __str__(self) -> str:
        return self.message


class SourceNotFoundError(UCFormatError, FileNotFoundError):
    """The source path (or a file it must contain) does not exist."""


class NotACheckpointError(UCFormatError):
    """The source exists but is not a DeepSpeed ZeRO checkpoint."""


class UnsupportedCheckpointError(UCFormatError):
    """A DeepSpeed checkpoint of a kind ucformat cannot convert (e.g. tensor parallelism)."""


class UnsupportedExportError(UCFormatError):
    """The store cannot fill the requested export (missing state, unsupported layout or option)."""


class TruncatedFileError(UCFormatError):
    """A shard file is cut short or its zip container is damaged."""


class SourceChecksumError(TruncatedFileError):
    """A member of a source zip file fails its CRC-32: the file was damaged after it was written."""


class UnsafePickleError(UCFormatError):
    """A pickle references a global that is not on the allow-list; nothing was executed."""


class LayoutMismatchError(UCFormatError):
    """Shard contents disagree with the ZeRO layout implied by ``param_shapes``."""


class CoverageError(UCFormatError):
    """Fragments do not tile a parameter exactly (hole, overlap or overflow)."""


class InvalidNameError(UCFormatError):
    """A parameter, buffer or state name that the store's key rule (format.md §2.4) refuses."""


class ManifestError(UCFormatError):
    """The manifest is missing, unparsable, or fails validation."""


class UnsupportedVersionError(ManifestError):
    """The store was written by a newer, incompatible format version."""


class IncompleteStoreError(ManifestError, FileNotFoundError):
    """The store has no committed manifest (an interrupted or running convert)."""


class NotAStoreError(ManifestError, FileNotFoundError):
    """The path holds neither a ucformat manifest nor the root of a ucformat zarr store."""


class StoreExistsError(UCFormatError, FileExistsError):
    """The destination already holds data and overwriting was not requested."""


class OutOfRangeError(UCFormatError, IndexError):
    """A read asks for elements outside the array."""


class StoreBusyError(StoreExistsError):
    """Another writer holds the destination's lock (docs/format.md §6.3)."""


class ParamNotFoundError(UCFormatError, KeyError):
    """A parameter name or state key is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class ChunkMissingError(UCFormatError, FileNotFoundError):
    """A chunk the manifest promises is absent from the store."""


class CorruptDataError(UCFormatError):
    """Stored bytes fail their checksum or cannot be decoded."""


class StoreAccessError(UCFormatError):
    """A store URL cannot be opened: unknown protocol, or its fsspec backend is not installed."""


class StoreWriteError(UCFormatError, OSError):
    """The store refused a write (a failed object-store PUT, no space, no permission): nothing
    was committed."""


class ModelMismatchError(UCFormatError):
    """The target model's parameters do not match the checkpoint's."""


class CollectiveError(UCFormatError):
    """A step that every rank runs together (a save, a convert, a load) failed on some rank,
    or some rank did not answer in time; no rank committed or loaded anything.

    Raised on every rank with the same one-line message, naming the ranks that failed and
    their messages (on a failing rank, chained to its original exception). ``rank`` is the
    first failing rank and ``error_type`` its error's class name; ``failures`` maps every
    failing rank to its message, ``missing`` lists the ranks that did not answer.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int = -1,
        error_type: str = "",
        failures: dict[int, str] | None = None,
        missing: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.failures = dict(failures or {})
        self.missing = tuple(missing)


#: The names of :class:`CollectiveError` before there was one agreement (same class).
DistributedWriteError = CollectiveError
SaveAbortedError = CollectiveError
LoadAbortedError = CollectiveError
