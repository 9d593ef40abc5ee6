"""``hvd.elastic``: the elastic names where Horovod keeps them."""

from elastic.state.states import ObjectState, State, TorchState
from elastic.training.sampler import ElasticSampler
from elastic.worker.run_loop import run

__all__ = ["run", "ElasticSampler", "ObjectState", "State", "TorchState"]
