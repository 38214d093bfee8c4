"""Benchmarks of the scheduling core: cost-model fits, policies, sampler plans, memory plans
(docs/scheduling.md, docs/cost_model.md, docs/memory.md)."""
