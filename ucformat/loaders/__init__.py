"""Loaders: fill a training job's partitions from a ucformat store."""
