"""What can go wrong with a checkpoint, by kind: the store treats each differently."""

from __future__ import annotations

from collections.abc import Iterable

from elastic.exceptions import ElasticError


class CheckpointError(ElasticError):
    """A checkpoint could not be written or read."""


class CorruptCheckpoint(CheckpointError):
    """A manifest or blob was read and does not verify (checksum, size or format).

    The only kind that quarantines files (renamed ``*.corrupt``, never deleted).
    """

    def __init__(self, message: str, bad_blobs: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.bad_blobs = list(bad_blobs)


class Unusable(CheckpointError):
    """A checkpoint that verifies but cannot be used here: written in a newer format, its
    objects do not unpickle (a renamed class, a library upgrade), or it does not fit the
    state (another model or optimizer). Never quarantined: its content is intact."""


class NewerFormat(Unusable):
    """Written by a newer elastic, in a format this one cannot read."""


class Unreadable(CheckpointError):
    """A file could not be read even after retries (an OSError: EIO, ESTALE, EMFILE,
    missing...). Says nothing about its content: the checkpoint is skipped for this
    load and nothing is renamed."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause
