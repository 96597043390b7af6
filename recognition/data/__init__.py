"""Datasets, dataset indexes and evaluation protocol files."""
