"""pre_fusion passes."""
