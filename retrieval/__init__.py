"""Retrieval below retriever.py: the index folder format (index.py), the dense encoder and exact FAISS
search (dense.py), BM25 without Java (bm25.py), in-process search over a folder of either kind with its
cache and query checks (search.py), and the Search-R1 compatible HTTP server over that search (server.py).
Nothing here imports retriever.py.
"""
