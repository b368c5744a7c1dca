"""raystudy.study: a study spec run end to end on Ray Tune, and the study directory it leaves.

* :mod:`~raystudy.study.spec`: the study spec (YAML presets, validation, the grid);
* :mod:`~raystudy.study.jobs`: a spec -> the config of each job it runs;
* :mod:`~raystudy.study.tune`: :func:`~raystudy.study.tune.run_study` (plasticity, the Tune grid, analysis);
* :mod:`~raystudy.study.callback`, :mod:`~raystudy.study.search`: the Tune callback and Optuna searcher;
* :mod:`~raystudy.study.progress`: the study's terminal lines;
* :mod:`~raystudy.study.results`: the result tables and :func:`~raystudy.study.results.load_study`;
* :mod:`~raystudy.study.pretrain`: the demo's built-in data and pretraining.

Importing this package imports nothing heavy; the modules above import Ray only where they need it.
"""
