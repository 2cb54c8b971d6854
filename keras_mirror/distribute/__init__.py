"""Distribution set-up: devices and logical CPUs, clusters and resolvers,
strategies, the multi-worker handshake, variable homes, worker input and
preemption."""
