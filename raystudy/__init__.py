"""raystudy: Ray-distributed studies of how transformer components adapt during finetuning.

The science lives in :mod:`raystudy.core` (pure PyTorch, no Ray); data stores in :mod:`raystudy.data`;
Ray orchestration in :mod:`raystudy.distributed` and :mod:`raystudy.study`; tables and figures in
:mod:`raystudy.analysis`.
"""

__version__ = "0.1.0"
