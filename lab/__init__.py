"""The lab around the method: the credit audit (audit.py, audit_methods.py), the chains benchmark (benchmark.py),
tables and plots of finished runs (report.py) and episode replay (replay.py). It imports the method; the method
never imports it.
"""
