"""``hvd.elastic``: the elastic names where Horovod keeps them."""

from ..run_loop import run
from ..sampler import ElasticSampler
from ..state import ObjectState, State, TorchState

__all__ = ["run", "ElasticSampler", "ObjectState", "State", "TorchState"]
