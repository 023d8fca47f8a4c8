"""One training run: the step loop (`driver`), prompts (`data`), combining rewards (`scoring`), metrics
(`metrics`), checkpoints (`checkpoint`) and resuming (`resume`)."""
