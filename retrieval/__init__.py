"""Retrieval beyond the dense library of retriever.py: BM25 without Java (bm25.py) and the Search-R1 compatible
HTTP server with its load bench (server.py).
"""
