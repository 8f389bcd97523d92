"""The learner peer: admit trajectories from anyone (after re-scoring them), buffer, update, publish.

:mod:`.intake` re-scores and admits, :mod:`.buffer` holds admitted batches (torch-free), :mod:`.update` is
the one update step (the swarm learner and the one-process loop both call it), :mod:`.state` the learner's
durable state."""
