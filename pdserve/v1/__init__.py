"""Generated protobuf / gRPC code for package pdserve.v1 (`make proto`; never edit by hand)."""
