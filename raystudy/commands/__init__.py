"""Sub-commands of the ``raystudy`` CLI: one module each, exposing ``register(subparsers)``."""
