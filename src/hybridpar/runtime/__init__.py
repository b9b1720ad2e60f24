"""The runtime half: execute a ParallelPlan on torch.distributed and measure it."""
