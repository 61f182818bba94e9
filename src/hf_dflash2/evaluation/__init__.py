"""Measuring heads and decoding methods: ``bench.py`` runs ``hf-dflash2 bench``, every decoding method on the
same prompts, interleaved, in one process. Held-out τ of a head is ``benchmarks/training/heldout_tau.py``."""
