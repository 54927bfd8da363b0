"""The model runtime both pools share: config, weights, transformer, paged KV, sampler, scheduler.

It knows nothing about gRPC, the network or other workers. The public names other components
code against (ModelConfig, load_weights, Tokenizer, SamplingParams, LLMEngine and its
disaggregation hooks reserve / commit_prefilled / add_prefill_request / release) are fixed in
docs/engine-contract.md — read it before changing the engine's surface, and keep it true.
"""
