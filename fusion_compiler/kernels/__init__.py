"""Kernels of this package's own, each a ``torch.library`` custom op with a Triton
implementation on CUDA and a PyTorch one elsewhere."""
