"""Tensor parallelism: the process group of a worker's ranks and the layers sharded over it."""
