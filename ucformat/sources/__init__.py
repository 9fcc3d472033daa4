"""Readers of foreign checkpoint formats. Only this package unpickles files."""
