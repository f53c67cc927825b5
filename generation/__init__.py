"""The generation engine: the next turn of many rows at once, every token a keyed draw (DESIGN.md section 11).

engine.py decodes; kvcache.py holds its slot cache; rows.py gives each row its noise address; stops.py ends a
turn; logprobs.py computes the loss's token log-probs without (B, L, V) tensors. Nothing here knows a reward, a
retriever or a twin.
"""
