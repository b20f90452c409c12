"""The worker: its lifecycle, one session per client, its slots, and the process around it."""
