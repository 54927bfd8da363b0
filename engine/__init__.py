"""The model runtime both pools share: config, weights, transformer, paged KV, sampler, scheduler.

It knows nothing about gRPC, the network or other workers.
"""
