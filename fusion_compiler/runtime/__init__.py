"""Runtime pieces: the region custom op, the on-disk plan cache, the CUDA-graph runners, tiered
compiles, derived weights, background work, tensor helpers."""
