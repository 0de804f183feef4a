"""post_lowering passes."""
