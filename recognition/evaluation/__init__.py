"""Verification metrics, embedding extraction and export, and their plots."""
