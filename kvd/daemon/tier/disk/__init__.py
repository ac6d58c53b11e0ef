"""The KV tier's disk level (daemon process): pages beyond RAM and beyond a restart, in `--cache-dir`.

`level` (DiskTier: what is written and when, clears, shutdown) and `readback` (reads back into the
pool) run on the event loop and hand every file operation (`page_files`) to worker threads; the page
format (`disk_format`) and the index (`disk_index`) are pure bookkeeping; `media` and `latency` are
its figures.
"""
