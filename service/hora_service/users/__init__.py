"""The service's users (control plane).

Accounts and tokens, homes and disks, per-user quotas and accounting.
"""
