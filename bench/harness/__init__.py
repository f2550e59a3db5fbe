"""The benchmark harness used by bench/run.py (measurement, cache control, cases, report, chart)."""
