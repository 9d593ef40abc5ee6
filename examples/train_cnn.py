"""A small CNN on synthetic images: ElasticSampler, lr scaling and durable checkpoints.

    elasticrun -np 2 --min-np 1 -H localhost:1,127.0.0.1:1 python examples/train_cnn.py
    python examples/train_cnn.py --checkpoint-dir /tmp/cnn-ckpt     # one worker, no elasticrun

Run it again with the same --checkpoint-dir (or elasticrun --checkpoint-dir) and it
resumes from the newest good checkpoint.
"""

import argparse

import torch

import elastic


def synthetic_images(n=1024, seed=0):
    """Label = which quadrant of a 16x16 image holds a bright square."""
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 1, 16, 16, generator=g) * 0.2
    labels = torch.randint(0, 4, (n,), generator=g)
    for i, label in enumerate(labels.tolist()):
        row, col = divmod(label, 2)
        images[i, 0, row * 8 + 2: row * 8 + 6, col * 8 + 2: col * 8 + 6] += 1.0
    return torch.utils.data.TensorDataset(images, labels)


def make_model():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 4))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args(argv)

    elastic.init()
    torch.manual_seed(0)
    dataset = synthetic_images()
    model = make_model()
    optimizer = elastic.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters())
    scaler = elastic.LRScaler(optimizer, base_size=1, rule="linear")   # lr x world size
    sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    checkpoint = elastic.Checkpointer(args.checkpoint_dir, every_commits=20) \
        if args.checkpoint_dir else None
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0,
                               elastic_checkpoint=checkpoint)
    state.register_reset_callbacks([scaler])

    @elastic.run
    def train(state):
        while state.epoch < args.epochs:
            state.sampler.set_epoch(state.epoch)
            correct = seen = 0
            for batch_idx, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                out = model(x)
                torch.nn.functional.cross_entropy(out, y).backward()
                optimizer.step()
                correct += (out.argmax(1) == y).sum().item()
                seen += len(y)
                state.sampler.record_batch(batch_idx, args.batch_size)
                state.batch += 1
                elastic.report_progress(step=state.batch)
                if state.batch % 4 == 0:
                    state.commit()
            if elastic.rank() == 0:
                print(f"epoch {state.epoch}: {elastic.size()} workers, "
                      f"train accuracy {correct / max(seen, 1):.3f}", flush=True)
            state.epoch += 1
            state.commit()
        return correct / max(seen, 1)

    return train(state)


if __name__ == "__main__":
    main()
