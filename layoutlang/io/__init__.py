"""Model descriptions and weights on disk: Hugging Face ``config.json``, safetensors
headers and indexes (both without torch), and the torch-side weights module
(:mod:`layoutlang.io.weights`: synthetic weights, verification, safetensors checkpoints).
"""
