"""What both ends agree on (daemon and worker processes): the protocol's messages and their
encoding (`protocol`), the local socket's framing (`framing`), where an entry's bytes live
(`layout`), dtypes, checksums, and how endpoints are spelled (`endpoints`).

Pure: these modules import nothing of kvd but each other and `kvd.errors`, and no sockets,
asyncio, ZeroMQ or torch (tests/test_layering.py checks it), so any process can use them.
"""
