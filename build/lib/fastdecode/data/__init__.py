"""Datasets: readers (sources.py), the data config (config.py), chat formatting and packing (chat.py)."""
