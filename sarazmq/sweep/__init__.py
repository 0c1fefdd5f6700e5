"""`sarazmq sweep`: the chunk-size x long-prompt-share x load grid, one row per point.

- `grid`: the grid, its points and their stable keys (chunk-independent policies once).
- `mix`: the workload of a point: short and long prompts mixed at a share, Poisson arrivals.
- `metrics`: a point's row (latency percentiles, stall, busy fraction, MFU/MBU, goodput).
- `store`: points.jsonl (resumable), points.csv, sweep.json.
- `runner`: runs the grid (resumable); `backends`: real deployments or the simulator.
- `report` / `plots`: the best-chunk table and the curves.
"""
