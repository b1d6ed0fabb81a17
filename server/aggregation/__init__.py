"""What the coordinator computes each round: the round drivers (synchronous and buffered), secure rounds,
screening, the outer-optimizer stability check, pseudo-gradients, checkpoints."""
