"""The KV tier's disk level (daemon process): pages beyond RAM and beyond a restart, in `--cache-dir`.

`tier` (DiskTier: what is written and when, clears, shutdown) and `readback` (reads back into the
pool) run on the event loop and hand every file operation (`files`) to worker threads; the page
format and the index are pure bookkeeping (`kvd.daemon.store.disk_format`, `disk_index`).
"""
