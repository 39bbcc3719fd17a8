"""memfit."""
