"""Iteration cost and latency models: what one hybrid iteration costs and how long it takes.

- `shape`: `IterationShape`, the features of one iteration (from a plan or from lengths).
- `model`: the `LatencyModel` protocol and the fitted piecewise-linear model.
"""
