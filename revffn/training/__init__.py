"""The one training loop (loop.py), its config (config.py), LR schedule and checkpoints."""
