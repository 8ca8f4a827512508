"""The Mooncake store: ``master`` (the run's master and segment holder), ``store`` (its sink and source)."""
