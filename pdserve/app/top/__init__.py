"""``pdserve top``: a live view of a running cluster from the Prometheus metrics it exports.

``stats`` holds the pure computations (parse exposition text, differences of two scrapes, PromQL's
``histogram_quantile`` over buckets, the rows shown), ``scrape`` finds the targets and fetches their
``/metrics``, ``view`` draws the rows with ``rich`` and runs the refresh loop.
"""
