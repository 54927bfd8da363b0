"""pdserve: decode_service."""
