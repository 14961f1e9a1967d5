"""One TLS context for the HTTP clients a test process makes (:func:`tls`).

httpx builds a new SSL context for every client it makes (``httpx.get`` makes a client per
call), and loading the machine's CA bundle into it costs about 45 ms of CPU. A CI profile of
the e2e workers found that to be the largest part of their own CPU: a service's start polls
``/healthz`` with a new client each try. The tests talk plain HTTP to 127.0.0.1, so the context
is never used for a connection; one made once (as httpx makes it, ``SSL_CERT_FILE`` and all)
serves every client: pass ``verify=tls()``. (Not ``http.py``: rank processes run with this
folder first on ``sys.path``, where that name would hide the standard library's ``http``.)
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def tls() -> ssl.SSLContext:
    """httpx's default SSL context, made once per process."""
    return httpx.create_ssl_context()
