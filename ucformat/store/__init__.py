"""Bytes to and from a store (zarr v3 objects, the manifest, durability)."""
