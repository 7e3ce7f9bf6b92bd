"""Where the model goes and whether it fits: the job's memory (weights, KV cache, activations,
gradients, optimizer state), device_map and max_memory, offload, and bitsandbytes quantization.

May import: core/, hardware/, model/, launch/, device/, measure/, precision/, attention/.
"""
