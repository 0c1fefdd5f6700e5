"""The parts of scripts/bench_engine.py (run that script; it puts this folder on the path)."""
