"""A synthetic-data MLP trained elastically: the script `make demo` runs.

Run it under elasticrun (see demo.py) or on its own as a single worker:
    python examples/train_mlp.py
"""

import os
import time

import torch

import elastic

EPOCHS = int(os.environ.get("DEMO_EPOCHS", "4"))
STEP_SLEEP = float(os.environ.get("DEMO_STEP_SLEEP", "0.0"))   # stands in for real work


def main():
    elastic.init()
    torch.manual_seed(0)
    features = torch.randn(2048, 32)
    labels = (features[:, :4].sum(dim=1) > 0).long()
    dataset = torch.utils.data.TensorDataset(features, labels)

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    # Nothing here asks for rank() or size(): a newcomer joins the job only when
    # it reaches train(), so the running workers never wait for its set-up.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer = elastic.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=42)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    # lr x world size (the linear rule), applied inside step() and updated at every
    # membership change; group["lr"] keeps 1e-3. Made last: it reads the world size,
    # which joins the job, and the set-up is done by now.
    state.register_reset_callbacks([elastic.LRScaler(optimizer, base_size=1, rule="linear")])

    @elastic.run
    def train(state):
        while state.epoch < EPOCHS:
            state.sampler.set_epoch(state.epoch)
            for batch_idx, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(batch_idx, loader.batch_size)
                state.batch += 1
                elastic.report_progress(step=state.batch, loss=loss.item())
                time.sleep(STEP_SLEEP)
                if state.batch % 5 == 0:
                    state.commit()
                if elastic.rank() == 0 and state.batch % 20 == 0:
                    print(f"epoch {state.epoch} step {state.batch} workers {elastic.size()} "
                          f"loss {loss.item():.4f}", flush=True)
            state.epoch += 1
            state.commit()

    train(state)
    if elastic.rank() == 0:
        print(f"done: {state.batch} steps, final world size {elastic.size()}", flush=True)


if __name__ == "__main__":
    main()
