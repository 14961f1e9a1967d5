import os
import sys
from pathlib import Path

# tests/helpers is importable as `helpers` from every test module.
sys.path.insert(0, str(Path(__file__).parent))

# Tests run as root (CI does), where the service's default is multi-user mode: every user
# needs an OS account of their own. Tests that are not about isolation run the service in
# shared mode (several users, jobs as the test's own account); the isolation tests
# (tests/e2e/test_service_isolation.py) ask for multi-user mode explicitly.
os.environ.setdefault("HORA_USER_MODE", "shared")
