"""Datasets: each module holds one, as a subclass of `InMemoryData`."""
