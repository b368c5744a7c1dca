"""Starting Ray, once, the same way for every command: quiet unless asked to talk.

A study's terminal should show the study (one line per finished trial, a periodic summary), not Ray's own
INFO lines, raylet warnings or progress bars. :func:`init_ray` connects to ``address`` (or ``RAY_ADDRESS``)
or starts a local instance, with Ray's loggers at WARNING and worker output kept in Ray's log files unless
``verbose``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

RAY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune")


def quiet_ray_logs(verbose: bool = False) -> None:
    """Ray's Python loggers at WARNING (DEBUG/INFO when ``verbose``)."""
    level = logging.INFO if verbose else logging.WARNING
    for name in RAY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def init_ray(address: str | None = None, *, verbose: bool = False, **kwargs: Any) -> bool:
    """Connect to ``address`` (a cluster; default ``RAY_ADDRESS``) or start a local Ray.

    Returns ``True`` if this call started or connected Ray (the caller then shuts it down), ``False`` if
    Ray was already initialised. Extra ``kwargs`` go to ``ray.init`` (e.g. ``num_cpus`` in tests).
    """
    import ray

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if ray.is_initialized():
        return False
    quiet_ray_logs(verbose)
    address = address or os.environ.get("RAY_ADDRESS")
    options: dict[str, Any] = {"log_to_driver": verbose, "configure_logging": verbose,
                               "logging_level": logging.INFO if verbose else logging.WARNING}
    if not address:
        options["include_dashboard"] = False
    options.update(kwargs)
    ray.init(address=address, **options)
    if not verbose:
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False
    return True
