"""What a run reports: per-step metrics and their reduction over ranks, the loggers, the reward curve."""
