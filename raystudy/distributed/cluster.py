"""Starting Ray, once, the same way for every command: quiet unless asked to talk.

A study's terminal should show the study (one line per finished trial, a periodic summary), not Ray's own
INFO lines, raylet warnings or progress bars. :func:`init_ray` connects to ``address`` (or ``RAY_ADDRESS``)
or starts a local instance. Unless ``verbose`` it silences, each at its source (Ray 2.60):

* Ray's Python loggers (``ray``, ``ray.data``, ``ray.train``, ``ray.tune``) at WARNING, and the console
  handler that ``import ray.data`` installs on ``ray.data`` (level INFO: "Starting execution of Dataset ...")
  at WARNING too; its log file keeps everything;
* the notices Ray logs as warnings although nothing is wrong (:data:`BENIGN_NOTICES`): the token-auth
  notice of a new local instance and Ray Data's "Progress bars disabled";
* worker output and raylet messages forwarded to the driver (``log_to_driver=False``; the raylet's error
  channel prints regardless of that flag, see :func:`_silence_forwarded_messages`);
* the ERROR lines that Ray's C++ core worker in the driver writes straight to file descriptor 2 (e.g.
  ``core_worker.cc: Actor ... has constructor arguments in the object store``, printed for every Ray Data
  actor pool): fd 2 goes to ``driver-stderr.log`` in Ray's session log directory while Python's own
  ``sys.stderr`` (tracebacks, progress bars, warnings) stays on the terminal (:func:`_divert_native_stderr`).

With ``verbose`` Ray prints as it always does. Ray's logs are never lost: they are in its session log
directory (``/tmp/ray/session_latest/logs``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

RAY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune")

#: (logger, message prefix) of the warnings Ray logs although nothing needs the user's attention.
BENIGN_NOTICES: tuple[tuple[str, str], ...] = (
    # Ray >= 2.5x turns token authentication on for a new local instance and says so at every start.
    ("ray._private.authentication.authentication_token_setup", "Token authentication is enabled for this"),
    # Printed at every Ray Data execution when progress bars are off (as they are here unless verbose).
    ("ray.data._internal.progress", "Progress bars disabled"),
    ("ray.data._internal.progress", "Progress bars for operators disabled"),
    # Tune's traceback of a failed trial task (a lost node, a raised error): the study's terminal names the
    # trial and its error in one line ("retrying ... after a failure (...)", or its "failed" line), and the
    # trial's summary.json keeps the error
    ("ray.tune.execution.tune_controller", "Trial task failed for trial"),
)


class DropMessages(logging.Filter):
    """A logging filter that drops records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefixes)


def quiet_ray_logs(verbose: bool = False) -> None:
    """Ray's Python loggers at WARNING (INFO when ``verbose``), without its benign notices."""
    level = logging.INFO if verbose else logging.WARNING
    for name in RAY_LOGGERS:
        logging.getLogger(name).setLevel(level)
    for name, prefix in BENIGN_NOTICES:
        logger = logging.getLogger(name)
        mine = [f for f in logger.filters if isinstance(f, DropMessages) and prefix in f.prefixes]
        if verbose:
            for f in mine:
                logger.removeFilter(f)
        elif not mine:
            logger.addFilter(DropMessages((prefix,)))


def _quiet_ray_data() -> None:
    """``import ray.data`` configures its logger with a console handler at INFO: raise it to WARNING."""
    import ray.data  # noqa: F401  (configures the "ray.data" logger on first import)
    from ray.data import DataContext

    for handler in logging.getLogger("ray.data").handlers:
        if handler.get_name() == "console":
            handler.setLevel(logging.WARNING)
    DataContext.get_current().enable_progress_bars = False
    # torch's notice when Ray Data wraps a read-only Arrow buffer in a tensor (iter_torch_batches): the
    # batches are never written to in place
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                            module=r"ray\.data")


def _silence_forwarded_messages() -> None:
    """Stop the driver from printing raylet messages (``(raylet) ...``) it receives from the cluster.

    ``log_to_driver=False`` stops worker output but not the raylet's error channel, which Ray prints from a
    driver thread through ``print_worker_logs``; that function honours this module flag (Ray sets it while
    a debugger breakpoint is active). The messages stay in the raylet's log files.
    """
    from ray._private import worker

    if hasattr(worker, "_worker_logs_enabled"):
        worker._worker_logs_enabled = False


def _divert_native_stderr() -> str | None:
    """Point file descriptor 2 at ``driver-stderr.log`` in Ray's session log directory; keep ``sys.stderr``
    (Python's writes) on the original terminal. Returns the log file, or ``None`` when left as it was.

    Only file descriptor 2 itself moves: the C++ core worker of the driver logs its ERROR lines there.
    Skipped when stderr is not a real file descriptor (a notebook, pytest's capture).
    """
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    if fd != 2:
        return None
    try:
        from ray._private.worker import _global_node

        logs_dir = _global_node.get_logs_dir_path()
    except Exception:  # an internal of Ray: without it, leave stderr alone
        return None
    path = os.path.join(logs_dir, "driver-stderr.log")
    sys.stderr.flush()
    terminal = os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
    return path


def token_file() -> str:
    """Where Ray keeps its authentication token (``~/.ray/auth_token``)."""
    try:
        from ray._private.authentication.authentication_token_setup import _get_default_token_path

        return str(_get_default_token_path())
    except Exception:  # an internal of Ray: its documented default
        return os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def restrict_token_file() -> None:
    """Make Ray's token file readable by its owner only (Ray writes it with the umask's mode, e.g. 0644,
    and whoever reads it can run code on the cluster)."""
    path = token_file()
    try:
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o600)
    except OSError:  # no token (authentication off), or not ours to change
        pass


class ClusterAuthError(ValueError):
    """A cluster that asks for Ray's token while this process would send none (one line, exit status 2)."""


#: a cluster's GCS address as ``ray start`` prints it (``host:port``, ``[ipv6]:port``): what :func:`auth_problem` asks
_GCS_ADDRESS = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}")
#: the cheapest call of the GCS: it answers at once, and a cluster with token authentication refuses it without one
_GCS_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def auth_problem(address: str | None, timeout_s: float = 3.0) -> str | None:
    """Why Ray could not join the cluster at ``address`` (default ``RAY_ADDRESS``) for want of a token: one
    line naming ``RAY_AUTH_MODE=token`` and the token file, or ``None`` (no cluster named, token mode set,
    the cluster answers without a token, or it cannot be asked: Ray then says what it says).

    Ray 2.60's ``ray start`` turns token authentication on wherever a token exists, while a driver given an
    address sends its token only under ``RAY_AUTH_MODE=token``; without it ``ray.init`` retries for ~20 s
    (``InvalidAuthToken`` lines) and ends in a ``ConnectionError`` that names neither. One gRPC call to the
    GCS without a token (milliseconds) tells the two apart before anything starts."""
    address = address or os.environ.get("RAY_ADDRESS")
    if (not address or not _GCS_ADDRESS.fullmatch(address)
            or os.environ.get("RAY_AUTH_MODE", "").lower() == "token"):
        return None  # "local", "auto", ray:// (Ray Client), or this process sends its token
    try:
        import grpc  # Ray's own dependency; light beside Ray

        with grpc.insecure_channel(address) as channel:
            channel.unary_unary(_GCS_PROBE)(b"", timeout=timeout_s)  # an empty request: raw bytes
    except Exception as e:  # grpc.RpcError: refused, unreachable, too slow; anything else: not ours to judge
        code = getattr(e, "code", None)
        if callable(code) and getattr(code(), "name", "") == "UNAUTHENTICATED":
            where = os.environ.get("RAY_AUTH_TOKEN_PATH") or token_file()
            return (f"the Ray cluster at {address} requires token authentication: set RAY_AUTH_MODE=token, and "
                    f"put the cluster's token in {where} (or RAY_AUTH_TOKEN)")
    return None


def check_cluster_auth(address: str | None) -> None:
    """Raise :class:`ClusterAuthError` with :func:`auth_problem`'s line, if any, before anything connects."""
    problem = auth_problem(address)
    if problem:
        raise ClusterAuthError(problem)


def init_ray(address: str | None = None, *, verbose: bool = False, **kwargs: Any) -> bool:
    """Connect to ``address`` (a cluster; default ``RAY_ADDRESS``) or start a local Ray.

    Returns ``True`` if this call started or connected Ray (the caller then shuts it down), ``False`` if
    Ray was already initialised. Extra ``kwargs`` go to ``ray.init`` (e.g. ``num_cpus`` in tests).

    Authentication is Ray's own: a local instance gets token authentication (Ray's default, token in
    ``~/.ray/auth_token``, made owner-only: :func:`restrict_token_file`), a cluster keeps whatever its
    operator configured; only the notice Ray prints about the local default is dropped
    (:data:`BENIGN_NOTICES`), ``RAY_AUTH_MODE`` is never changed.
    """
    import ray

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if ray.is_initialized():
        return False
    quiet_ray_logs(verbose)
    # "local", not None: Ray's None would join whatever instance last ran on this machine (another study,
    # a test session), where the user asked for a fresh one; a cluster is always named (or RAY_ADDRESS).
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    options: dict[str, Any] = {"log_to_driver": verbose, "configure_logging": verbose,
                               "logging_level": logging.INFO if verbose else logging.WARNING}
    if not address or address == "local":  # an instance of our own: no dashboard to serve
        options["include_dashboard"] = False
    else:
        check_cluster_auth(address)  # one line now, not ~20 s of Ray's retries and a ConnectionError
    options.update(kwargs)
    ray.init(address=address, **options)
    restrict_token_file()
    if not verbose:
        _quiet_ray_data()
        _silence_forwarded_messages()
        _divert_native_stderr()
    return True


# --- placement groups left behind by dead Ray Train controllers (issue 15) ---


def remove_orphaned_placement_groups() -> list[str]:
    """Remove this job's placement groups whose creator, an actor, is dead; returns their ids (hex).

    A placement group created by an actor lives as long as the job, not the actor. Ray Train V2's
    controller creates its worker group's placement group; when the controller dies with its node (or with
    the Tune trial that started it), Ray Train's ``PlacementGroupCleaner`` is meant to remove it, but that
    cleaner asks the State API, which needs the dashboard (not installed without ``ray[default]``), and it
    never knows a placement group still pending at the controller's death. The orphan keeps its CPUs (or
    takes them once they free up, rescheduled from a dead node) and the retried trials wait for them
    forever. The driver's own placement groups (Tune's trials: no creator actor) and detached ones are kept.
    """
    import ray
    from ray._private.state import state
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    job = ray.get_runtime_context().get_job_id()
    removed = []
    for raw in state._connect_and_get_accessor().get_placement_group_table():  # the GCS, no dashboard needed
        pg = PlacementGroupTableData.FromString(raw)
        if (pg.state != PlacementGroupTableData.REMOVED and pg.creator_actor_dead and not pg.is_detached
                and not ray.ActorID(pg.creator_actor_id).is_nil() and pg.creator_job_id.hex() == job):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(pg.placement_group_id)))
            removed.append(pg.placement_group_id.hex())
    return removed


@contextlib.contextmanager
def orphaned_placement_groups_removed(period_s: float = 2.0) -> Iterator[None]:
    """While the block runs, :func:`remove_orphaned_placement_groups` every ``period_s`` seconds (a thread
    of the driver: around ``tuner.fit()`` of a study whose trials start Ray Train runs)."""
    done = threading.Event()

    def sweep() -> None:
        while not done.wait(period_s):
            try:
                removed = remove_orphaned_placement_groups()
            except Exception as e:  # an internal of Ray: never take the study down
                log.debug("could not look for orphaned placement groups: %s", e)
                continue
            if removed:
                log.warning("removed %d placement group(s) of dead Ray Train controllers: %s", len(removed),
                            ", ".join(removed))

    thread = threading.Thread(target=sweep, name="raystudy-orphaned-pgs", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
