"""Usage errors of elastic.torch, typed so that a ported script's ``except`` still matches.

Horovod's core refuses some ops with a RuntimeError where our checks first
raised ValueError; these classes are both, so neither kind of ``except`` misses
them. They are usage errors, raised on every rank of the op, never
WorkersDepartedError (HorovodInternalError), which would roll the job back.
"""

from elastic.exceptions import ElasticError


class UnsupportedOpError(ElasticError, ValueError):
    """An op or argument the collective cannot take (reducescatter with Adasum, Min,
    Max or Product, or of a scalar): a RuntimeError, as in Horovod, and a ValueError."""


class AdasumUnsupportedError(ElasticError, NotImplementedError, ValueError):
    """Adasum where it cannot run (a size that is not a power of two, integer tensors):
    a NotImplementedError, as in Horovod, and a ValueError."""
