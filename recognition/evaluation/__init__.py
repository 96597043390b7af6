"""Evaluation: verification on pairs, embedding extraction and export, re-id ranking, IJB-B/C
(1:1 and 1:N), and the tables, JSON files and plots they report with."""
