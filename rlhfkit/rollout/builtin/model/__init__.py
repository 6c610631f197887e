"""The builtin engine's model and its weights.

    families.py        how each family's decoder block departs from Llama's; HF parameter names -> engine tensors
    spec.py            HF config -> ModelSpec (of the whole model or of one tensor-parallel shard)
    rope.py            the rotary embedding tables
    weights.py         the engine's fused weights: layout, HF name -> tensor view, loading, per-shard slices
    shared_weights.py  the engine taking a training module's parameters over instead of copying them
    decoder.py         functional prefill / decode over the slot KV cache (DecoderModel)
    experts.py         routed experts (mixture-of-experts layers)
    vision.py          the vision tower, its output cache, the multimodal prefill plan
    tensor_parallel.py tensor-parallel shard groups and per-shard weight loading
    supported.py       builtin_support(config): whether the engine can run a model (its own checks)
"""
