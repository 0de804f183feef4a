"""Runtime pieces: the region custom op, the on-disk plan cache, the CUDA-graph runners, tiered
compiles, the side stream and its join op, tensor helpers."""
