"""Runtime pieces: the region custom op, the SE gate op (``se_gate``), the on-disk plan cache, the
CUDA-graph runners, tiered compiles, the layout of values between regions."""
