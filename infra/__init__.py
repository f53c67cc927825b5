"""Run plumbing: the command line (config.py), pinned CPU numerics (numerics.py), run folders and checkpoints
(checkpoint.py) and the LoRA option (lora.py). None of it is the method; the trainer and the lab use it.
"""
