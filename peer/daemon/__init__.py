"""The peer daemons: ``heterorl peer --role sampler`` (the volunteer) and ``--role learner``."""
