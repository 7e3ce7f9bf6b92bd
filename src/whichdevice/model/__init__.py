"""What the checkpoint says: its files read and checked (config.json, safetensors headers, the shard
index, Hub-cache links), its size, its stored dtype and which attention its classes support.

May import: core/.
"""
