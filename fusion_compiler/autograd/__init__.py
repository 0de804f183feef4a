"""Training: what a fused region saves for its backward and how its gradients are computed."""
