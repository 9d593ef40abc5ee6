"""Trains through as many rounds as the test publishes (tests/test_resources.py).

The test plays the driver (tests/support/harness.py): it publishes new rounds, and for
some it first aborts the current one. While $CHURN_OUT/slow exists, rank 1
sleeps before each step, so rank 0 waits inside an allreduce when the abort
comes and abandons work still in flight: the aborted-round path, not only the
graceful one. Training stops once $CHURN_OUT/stop exists (rank 0 decides).
"""

import json
import os
import time

import torch

import elastic

OUT = os.environ["CHURN_OUT"]


def main():
    elastic.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dist_opt = elastic.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = elastic.TorchState(model, optimizer, elastic_checkpoint=False, step=0)
    data = torch.randn(8, 16)

    @elastic.run
    def train(state):
        while True:
            if elastic.rank() == 1 and os.path.exists(os.path.join(OUT, "slow")):
                time.sleep(0.3)
            dist_opt.zero_grad()
            model(data).square().mean().backward()
            dist_opt.step()
            state.step += 1
            state.commit()
            stop = torch.tensor([1 if os.path.exists(os.path.join(OUT, "stop")) else 0])
            if int(elastic.broadcast(stop, 0)):
                return
            time.sleep(0.01)

    train(state)
    groups = elastic.worker.runtime.worker().retired_groups
    with open(os.path.join(OUT, f"done.{elastic.rank()}.json"), "w") as f:
        json.dump({"step": state.step, "released": groups.released, "waited": groups.waited,
                   "retired_now": len(groups)}, f)


if __name__ == "__main__":
    main()
