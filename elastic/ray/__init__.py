"""Elastic jobs on a Ray cluster: ``RayExecutor(min_np=..., max_np=...).run(fn)``.

Needs ``ray`` (``pip install elastic-train[ray]``); importing this package without it
raises ImportError with that hint.
"""

from elastic.ray.executor import RayExecutor

__all__ = ["RayExecutor"]
