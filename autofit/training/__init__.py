"""Training ONE plan: the step, the shared loop, run logs, checkpoints, data and several processes."""
