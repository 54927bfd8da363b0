"""Fixtures shared by several integration modules, registered once here so that a session-scoped
one really is started once (a fixture imported into each module is a fixture of each module)."""

from openai_cluster import http_cluster  # noqa: F401  (the HTTP door's shared 1P1D cluster)
