"""The serving engine: paged latent KV cache, continuous batching, chunked prefill, sampling, MTP
speculative decoding, run SPMD on every rank of a (possibly sharded) deployment."""
