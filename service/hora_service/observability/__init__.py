"""What people see of the service's jobs (control plane).

The queue view, a job's merged timeline, and the job-written files they read without trusting
them.
"""
