"""Durable checkpoints: the Checkpointer, the on-disk format, the writer, the directory lock."""

from elastic.checkpoint.checkpointer import Checkpointer, load, resolve
from elastic.checkpoint.format import CheckpointError, CorruptCheckpoint, Unreadable, list_checkpoints

__all__ = ["Checkpointer", "load", "resolve", "CheckpointError", "CorruptCheckpoint", "Unreadable",
           "list_checkpoints"]
