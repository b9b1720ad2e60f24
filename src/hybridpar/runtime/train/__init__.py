"""Training runs: data, the epoch loop over a HybridTrainer, reports, the `hybridpar train` job."""
