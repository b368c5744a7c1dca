"""Datasets: sources -> prepared Parquet store -> transforms (no Ray needed to read one batch)."""
