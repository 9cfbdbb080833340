"""The executor: scheduler, KV cache, model runner, sampler and the loop that drives them."""
