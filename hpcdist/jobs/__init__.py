"""Job kinds: each registers a name, a params model, and a runner imported only on the nodes."""
