"""The on-disk contract, torch-free: every name and record the supervisor and trainers share."""
