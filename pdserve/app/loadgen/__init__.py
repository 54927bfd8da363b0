"""`pdserve bench`: an open-loop (Poisson) load generator for the Router API, and its statistics."""
