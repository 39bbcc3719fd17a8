"""Planner: the fastest plan that fits a memory budget, found on predictions (no OOM trials)."""
