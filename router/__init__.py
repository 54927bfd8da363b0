"""pdserve: router."""
