"""Plain (Lightning-free) parts of LoadBalanceMonitor: per_rank_log (the per-rank CSV and its
meta file), balance (BalanceTracker: metrics of a log interval and the run summary), busy (per-rank
busy time from a torch.profiler window) and compile_counters (torch.compile recompiles and graph
breaks). The metric formulas themselves live in scheduling/metrics.py."""
