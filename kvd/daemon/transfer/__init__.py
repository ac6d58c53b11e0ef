"""The transfer machine (daemon process), pure: no sockets, no asyncio, no event loop.

`machine` holds every transfer's protocol state and turns peer messages into sends through a
`channel`; `table` decides what each (state, message) does; `states` are the transfers' records,
`window` the send window and receive ledger, `onesided` the data plane's grants, loans and slices,
`ranges` and `limits` their bounds; `invariants` is `validate()`.
"""
