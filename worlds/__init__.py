"""Where worlds come from: the built-in worlds' builder (build.py, with base.py, tiny.py and chains.py), their
content digests (lock.py, worlds.lock) and the committed builds beside them (tiny-0/, chains-0/), and the
preparation of the real data (data.py).
"""
