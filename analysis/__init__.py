"""Scaling analysis of hpcpar run records (pandas tables, plots, reports)."""
