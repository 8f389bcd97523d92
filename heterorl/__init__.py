"""HeteroRL: peer-to-peer volunteer-compute RL post-training of language models.

The import package is assembled from the repository's top-level folders:
``heterorl.peer`` (peer roles, objectives, rollouts, tasks, models), ``heterorl.protocol``
(everything that crosses the wire) and ``heterorl.coordinator`` (run hosting).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
