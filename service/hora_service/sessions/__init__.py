"""Sessions (control plane).

A notebook's interactive engines, scheduled and started like jobs, parked and resumed.
"""
