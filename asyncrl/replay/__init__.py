"""ZeroMQ replay buffer: server, clients, staleness-bounded admission and delivery, snapshots."""
