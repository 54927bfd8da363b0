"""pdserve: prefill_service."""
