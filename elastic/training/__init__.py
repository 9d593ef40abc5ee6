"""Training helpers: sampler, global batch, DistributedOptimizer, lr scaling, progress reports."""
