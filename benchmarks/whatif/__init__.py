"""Real A/B pairs for the what-if fidelity suite (``benchmarks/whatif_fidelity.py``)."""
