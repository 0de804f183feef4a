"""Runtime pieces: the region custom op, the on-disk plan cache, the CUDA-graph runner, the
layout of values between regions."""
