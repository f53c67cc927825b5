"""Retrieval below retriever.py: the index folder format (index.py), the dense encoder and exact FAISS
search (dense.py), BM25 without Java (bm25.py), and the Search-R1 compatible HTTP server over
retriever.py (server.py).
"""
