"""etcd user/password auth over the v3 JSON gateway (in whichever process talks to etcd, under etcd.py).

`POST /v3/auth/authenticate {"name", "password"}` answers a token, which every later call (watch
streams included) carries as its `Authorization` header. Tokens expire (etcd's --auth-token-ttl,
5 min idle by default; a restarted server forgets them all), so a call answered "invalid auth token"
logs in again, once, and is repeated. Concurrent calls that all find the token stale share one login
(each costs etcd a bcrypt check). The password lives only in this object and in the request body; no
message built here names it.
"""
from __future__ import annotations

import asyncio

from .etcd_http import GatewayClient, GatewayError, Headers

_INVALID_ARGUMENT, _PERMISSION_DENIED, _FAILED_PRECONDITION, _UNAUTHENTICATED = 3, 7, 9, 16


class TokenAuth:
    def __init__(self, user: str, password: str) -> None:
        self.user = user
        self._password = password
        self.token: str | None = None  # None: not logged in yet; "": the server has auth off
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"TokenAuth(user={self.user!r})"

    def headers(self) -> Headers:
        return [("Authorization", self.token)] if self.token else []

    def invalidate(self) -> None:
        """The server said the token is no longer good (a watch cancelled): log in on the next call."""
        self.token = None

    async def login(self, http: GatewayClient, stale: str | None = None) -> None:
        """A fresh token, unless another call already replaced `stale` meanwhile. Raises GatewayError
        (wrong password: code 3) for the caller to map."""
        async with self._lock:
            if self.token is not None and self.token != stale:
                return
            try:
                resp = await http.call("/v3/auth/authenticate", {"name": self.user, "password": self._password})
            except GatewayError as e:
                if e.code == _FAILED_PRECONDITION and "not enabled" in e.message:
                    self.token = ""  # auth is off: calls go without a token (and log in if it is turned on)
                    return
                raise
            self.token = str(resp.get("token") or "")

    @staticmethod
    def should_retry(e: GatewayError) -> bool:
        """A refusal that a fresh login cures: an expired token, or auth turned on since we looked."""
        return ((e.code == _UNAUTHENTICATED and "token" in e.message)
                or (e.code == _INVALID_ARGUMENT and "user name is empty" in e.message))


def refusal(e: GatewayError | str, name: str, user: str) -> str | None:
    """The RegistryRefused message for an etcd answer that means "not with these credentials", or None.
    `e` may be a watch's cancel reason."""
    text = e.message if isinstance(e, GatewayError) else e
    code = e.code if isinstance(e, GatewayError) else None
    who = f"user {user!r}" if user else "no user"
    if "CommonName of client" in text:  # (etcd takes a client certificate's CN for the user, password unread)
        return (f"etcd at {name} refused kvd's client certificate (--registry-cert): it has a CommonName, which "
                "etcd with auth on would take for the user name, ignoring the password; issue one with no "
                "CommonName (e.g. openssl req ... -subj /O=kvd; see docs/operations.md)")
    if "authentication failed" in text:
        return f"etcd at {name} refused kvd's credentials ({who}): {text}"
    if "user name is empty" in text:
        return (f"etcd at {name} has auth on and kvd gave no credentials: put the user in the URL "
                "(etcd://USER:PASS@HOST:PORT) or the password in --registry-password-file")
    if code == _PERMISSION_DENIED or "permission denied" in text:
        return f"etcd at {name} refused kvd ({who}): permission denied (grant it read and write on /kvd/)"
    if code == _UNAUTHENTICATED or "invalid auth token" in text:
        return f"etcd at {name} refused kvd's auth token ({who}) right after a fresh login: {text}"
    return None
