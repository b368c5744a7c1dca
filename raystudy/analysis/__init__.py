"""raystudy.analysis."""
