"""Scheduling, pure (control plane).

The scheduling pass and why each queued entry waits. Imports no other package of the service.
"""
