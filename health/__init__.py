"""health."""
