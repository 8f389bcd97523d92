"""``heterorl local``: the whole swarm on 127.0.0.1: coordinator, one learner, N samplers, each its own
process.

It builds the tiny offline model, makes the learner's key, writes ``run.toml``, starts the processes, shows
a live view (from the coordinator's ``/api/view``), stops everything after ``--steps`` learner updates and
writes ``OUT/summary.json``. Every process keeps its own state directory and log under OUT.
"""

from .main import run
from .options import REAL_MODEL_DIR, REAL_PRESET, add_arguments
from .procs import Proc, ready_line, stop_all

__all__ = ["REAL_MODEL_DIR", "REAL_PRESET", "Proc", "add_arguments", "ready_line", "run", "stop_all"]
