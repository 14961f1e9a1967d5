"""The job service's SQLite store (control plane).

Its file and connections, its schema, the journal of changes it has not taken yet, and the
probe behind ``/healthz``. Imports no other package of the service.
"""
