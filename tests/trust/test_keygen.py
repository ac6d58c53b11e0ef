"""`kvd keygen`: the CA flow's files, renewal that keeps a node's identity, and what is refused."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth

from kvd.errors import BadRequest
from kvd.trust import Authority, load_ca_public, load_ca_secret, load_cert, load_deny, load_node_keys
from kvd.trust.keygen import keygen_ca, keygen_node


def kvd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True, timeout=60)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_ca_flow_takes_two_keygen_commands(tmp_path):
    d = str(tmp_path / "D")
    made = kvd("keygen", "--ca", "--dir", d)
    assert made.returncode == 0, made.stderr
    node = kvd("keygen", "gpu-1", "--dir", d, "--ca-secret", f"{d}/ca.key_secret", "--cluster", "prod",
               "--valid-for", "2d")
    assert node.returncode == 0, node.stderr
    assert "cert:" in node.stdout and "node gpu-1 of cluster prod" in node.stdout
    assert mode(f"{d}/ca.key_secret") == 0o600 and mode(f"{d}/gpu-1.key_secret") == 0o600
    assert mode(f"{d}/ca.key") == 0o644 and mode(f"{d}/gpu-1.key") == 0o644 and mode(f"{d}/gpu-1.cert") == 0o644
    cert = load_cert(f"{d}/gpu-1.cert")
    Authority(load_ca_public(f"{d}/ca.key"), "prod").verify(cert.raw, "gpu-1")
    keys = load_node_keys(f"{d}/gpu-1.key_secret")
    assert cert.curve_z85 == keys.curve_public and cert.sign_public == keys.sign_public
    assert 2 * 86400 - 5 <= cert.not_after - cert.issued_at <= 2 * 86400
    # ZeroMQ reads the node's files as its own certificates (the allow-list way still works)
    public, secret = zmq.auth.load_certificate(f"{d}/gpu-1.key_secret")
    assert public == keys.curve_public and secret == keys.curve_secret
    assert zmq.auth.load_certificate(f"{d}/gpu-1.key")[1] is None
    assert "sign-secret-key" not in Path(f"{d}/gpu-1.key").read_text()  # the public file holds no secret


def test_signing_again_renews_the_cert_and_keeps_the_identity(tmp_path):
    d = str(tmp_path)
    keygen_ca(d)
    first = keygen_node(d, "n", ca_secret=f"{d}/ca.key_secret")
    keys, cert = load_node_keys(first.secret), load_cert(first.cert)
    again = keygen_node(d, "n", ca_secret=f"{d}/ca.key_secret", valid_for=2 * 86400)
    assert again.renewed and load_node_keys(again.secret) == keys
    renewed = load_cert(again.cert)
    assert renewed.curve_z85 == cert.curve_z85 and renewed.not_after != cert.not_after


def test_an_old_pair_gets_a_signing_key_and_keeps_its_curve_key(tmp_path):
    d = str(tmp_path)
    public, _secret = zmq.auth.create_certificates(d, "old")  # a pair from before certs
    keygen_ca(d)
    made = keygen_node(d, "old", ca_secret=f"{d}/ca.key_secret")
    keys = load_node_keys(made.secret)
    assert keys.curve_public == zmq.auth.load_certificate(public)[0] and keys.sign_seed is not None
    assert load_cert(made.cert).curve_z85 == keys.curve_public


def test_existing_keys_are_kept_unless_forced(tmp_path):
    d = str(tmp_path)
    keygen_ca(d)
    with pytest.raises(BadRequest, match=r"already exist.*--force"):
        keygen_ca(d)
    seed = load_ca_secret(f"{d}/ca.key_secret")
    keygen_ca(d, force=True)
    assert load_ca_secret(f"{d}/ca.key_secret") != seed
    keygen_node(d, "n")
    with pytest.raises(BadRequest, match="already exist"):
        keygen_node(d, "n")  # without --ca-secret, nothing to renew: a second pair would lock it out


def test_a_bad_ca_file_writes_nothing(tmp_path):
    d = str(tmp_path)
    (tmp_path / "ca.key_secret").write_text("nonsense\n")
    with pytest.raises(BadRequest, match="holds no CA secret"):
        keygen_node(d, "n", ca_secret=f"{d}/ca.key_secret")
    assert not (tmp_path / "n.key").exists() and not (tmp_path / "n.key_secret").exists()
    cli = kvd("keygen", "--dir", d)
    assert cli.returncode == 2 and "give a node NAME, or --ca" in cli.stderr


def test_the_deny_list_reads_z85_keys_and_names_a_bad_line(tmp_path):
    public, _ = zmq.curve_keypair()
    hashed = b"#" + public[1:]  # '#' is a Z85 digit: a key may begin with it
    path = tmp_path / "deny"
    path.write_text(f"# revoked 2026-12-03\n{public.decode()}  # gpu-17\n\n  {hashed.decode()}\n#another comment\n")
    assert load_deny(str(path)) == {public, hashed}
    path.write_text("not-a-key\n")
    with pytest.raises(BadRequest, match=r"deny:1: not a Z85"):
        load_deny(str(path))
