"""The transfer machine (daemon process), pure: no sockets, no asyncio, no event loop.

`machine` holds every transfer's protocol state and turns peer messages into sends through a
`channel`; `table` decides what each (state, message) does, on `kvd.statetable`'s engine, and its
rows' handlers are `sending`, `receiving`, `onesided` (the data plane's grants, loans and slices)
and `failures`; `states` are the transfers' records and the machine's books, `window` the send
window and receive ledger, `ranges` and `limits` their bounds; `invariants` is `validate()`.
"""
