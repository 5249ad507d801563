"""Helpers for the harness's own tests: the misbehaving stand-in server (`standin`) and the fault probes (`faults`)."""
