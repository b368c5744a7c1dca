"""raystudy.study."""
