"""Pure-PyTorch science: models, the component registry, plasticity, bounds, finetuning step.

Nothing in this package imports Ray: every number can be computed without a cluster.

Importing it registers every model family's adapter: timm's (:mod:`raystudy.core.components`) and
Hugging Face's (:mod:`raystudy.core.hf`, which imports no ``transformers`` until a model is built).
"""

from raystudy.core import hf as _hf  # noqa: F401  (registers the HF adapters, after timm's: hf imports components)
