"""raystudy.distributed."""
