"""The registry's backends (daemon and router processes): `backend` is the interface every backend
keeps; `etcd` (with `etcd_http`, its JSON gateway client, and `etcd_auth`, its login), `redis` (with
`redis_lua`, its scripts) and `inmemory` (one process, for tests and a single node) carry it out.
"""
