"""Rank grid, process groups and the outer-communication transport."""
