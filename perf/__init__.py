"""Instruments of speed and memory: the memory ledger (ledger.py, memprobe.py, memtrack.py), the speed benches
(bench.py, bench_engine.py), the retrieval server's load bench (bench_server.py) and the first-GPU check
(gpucheck.py). Nothing in the method imports them.
"""
