"""Pure-PyTorch science: models, the component registry, plasticity, bounds, finetuning step.

Nothing in this package imports Ray: every number can be computed without a cluster.
"""

from raystudy.core.components import (
    COMPONENTS,
    CONFIGURATIONS,
    UnsupportedModelError,
    embedding_parameters,
    get_adapter,
    head_parameters,
    trainable_parameters,
)

__all__ = [
    "COMPONENTS",
    "CONFIGURATIONS",
    "UnsupportedModelError",
    "embedding_parameters",
    "get_adapter",
    "head_parameters",
    "trainable_parameters",
]
