"""Benchmarks of jax_flash against jax's attention paths and other FlashAttention kernels.

``bench.configs`` holds the named problem grids; ``bench/bench_attention.py`` is the command-line
benchmark (see its docstring for usage).
"""
