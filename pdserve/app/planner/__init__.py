"""The SLO-driven planner: how many prefill and decode workers the load needs (docs/planner.md).

``signals`` reads one observation window from the cluster's Prometheus metrics, ``capacity`` holds what
one worker of each pool serves within the SLOs (seeded from a sweep, learned online), ``policy`` turns a
window into a target per pool with its reason (hysteresis, cool-downs, bounds, scale-down by drain),
``metrics`` exports the decisions, ``live`` runs the scrape loop of ``pdserve planner run`` and
``explain`` draws ``pdserve planner explain``. ``actuator`` applies the decisions to a local cluster
through ``Cluster.scale`` (``pdserve up --autoscale``) and holds the rules every actuator keeps; ``k8s``
applies them to a chart release's Deployments through their scale subresource, one planner replica acting
at a time under a Lease (``lease``).
"""
