"""One deployment, several GPU nodes: shard assignment, shared-storage probe, transfers."""
