"""Commit-able training state and the host-memory snapshots behind it."""
