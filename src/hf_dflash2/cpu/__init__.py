"""Running well on the machine at hand, mostly CPUs: nothing here changes a result.

- ``linear_kernels.py``: a model's linear layers on PyTorch's default kernel or oneDNN with packed weights
  (the per-forward choice itself lives in the remote-code ``kernels_dflash2.py``);
- ``precision.py``: ``--mixed-precision auto``, the dtype this machine is fast at for a workload;
- ``attention.py``: packed grouped-query SDPA, the same attention without copying keys and values per head;
- ``allocator.py``: glibc's thresholds raised so a training step keeps its freed pages.
"""
