"""``heterorl simulate``: a discrete-event model of a large run, built on the real bookkeeping."""
