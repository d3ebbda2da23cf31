"""Schedules: SpIEL's reselection count k(t)."""
