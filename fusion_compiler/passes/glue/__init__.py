"""glue passes."""
