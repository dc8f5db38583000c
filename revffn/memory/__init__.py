"""Memory: analytic estimates (estimate.py) and measurements (measure.py)."""
