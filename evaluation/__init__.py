"""Benchmark harness: speculative decoding against plain decoding and HF assisted generation.

``python -m evaluation.bench --help`` (or ``make bench``). The pure parts (prompt suite,
statistics, report rendering) are importable without torch or the services.
"""
