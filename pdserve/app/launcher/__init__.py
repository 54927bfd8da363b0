"""`pdserve up / down / scale`: start a cluster (prefill pool, decode pool, router) on Ray or as processes."""
