"""The cuDNN backend: each region as one cuDNN execution plan (:mod:`.backend`)."""
