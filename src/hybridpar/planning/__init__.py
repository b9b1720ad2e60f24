"""The planning half: analyse a model, price every style on a cluster, choose a plan."""
