"""The scheduling core: pure numpy, no tensors. See README.md in this folder for the flow
shapes -> buckets -> batch sizes -> epoch plan -> per-rank batches."""
