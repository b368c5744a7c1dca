"""The Ray layer: everything that runs on a Ray cluster (the science core, :mod:`raystudy.core`, imports no Ray).

* :mod:`raystudy.distributed.cluster`: :func:`~raystudy.distributed.cluster.init_ray`, the one way every
  command starts or connects Ray (quiet unless verbose);
* :mod:`raystudy.distributed.train`: a finetuning run on Ray Train (``run_finetune``, ``TrainResources``);
* :mod:`raystudy.distributed.plasticity`: the plasticity pipeline on Ray Data
  (``PlasticityJob``, ``run_plasticity``; :mod:`raystudy.distributed.plasticity_output`: ``combine_runs``).

Nothing is imported here, so ``import raystudy.distributed`` does not load Ray.
"""
