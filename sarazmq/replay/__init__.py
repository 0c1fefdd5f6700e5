"""Trace replay harness (engine-independent parts).

traces: readers for the real Azure / Mooncake / ShareGPT-lengths traces.
workload: WorkloadSpec -> WorkloadRequests (lengths, arrivals, fitting flags, prompts).
metrics: RequestRecord / IterationSample -> Sarathi-Serve's metrics (`summarize`).
report: summary.json, CSVs, PNG plots, console and comparison tables.
capacity: bounded search for the highest rate meeting P99 TBT and scheduling-delay SLOs.
"""
