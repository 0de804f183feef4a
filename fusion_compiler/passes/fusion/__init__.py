"""fusion passes."""
