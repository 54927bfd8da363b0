"""pdserve: disaggregated prefill/decode LLM serving. CLI, launcher, client, and generated protos."""

__version__ = "0.1.0"
