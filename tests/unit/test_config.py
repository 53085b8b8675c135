"""One validation per idea: transport names, load-failure policies and unknown keys are
checked by one function each, whichever edge the value comes from."""

from __future__ import annotations

import pytest

from deployments.app_config import AppConfig
from engine.arg_utils import EngineArgs
from engine.config import KV_TRANSPORTS, KVTransferConfig, config_from_dict
from pdserve.bench.kv import KVBenchConfig
from tests.unit.fake_connector import FakeConnector


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVTransferConfig(connector="carrier-pigeon"),  # type: ignore[arg-type]
        lambda: AppConfig.from_args({"transport": "carrier-pigeon"}),
        lambda: KVBenchConfig(transports=("nixl", "carrier-pigeon")),
    ],
)
def test_a_transport_outside_the_one_list_is_refused_everywhere(make) -> None:
    with pytest.raises(
        ValueError, match=r"must be one of \('nixl', 'grpc'\), got 'carrier-pigeon'"
    ):
        make()


def test_every_listed_transport_is_accepted_everywhere() -> None:
    for name in KV_TRANSPORTS:
        assert KVTransferConfig(connector=name).connector == name
        assert AppConfig.from_args({"transport": name}).transport == name
        assert KVBenchConfig(transports=(name,)).transports == (name,)


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVTransferConfig(kv_load_failure_policy="retry"),  # type: ignore[arg-type]
        lambda: FakeConnector(load_failure_policy="retry"),  # type: ignore[arg-type]
        lambda: AppConfig.from_args({"kv_load_failure_policy": "retry"}),
    ],
)
def test_an_unknown_load_failure_policy_is_refused(make) -> None:
    with pytest.raises(ValueError, match=r"one of \('recompute', 'fail'\), got 'retry'"):
        make()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: EngineArgs.from_kwargs("tiny", max_num_seq=4),
            "unknown engine argument(s) ['max_num_seq']; known: [",
        ),
        (
            lambda: AppConfig.from_args({"decode_replica": 2}),
            "unknown app argument(s) ['decode_replica']; known: [",
        ),
        (
            lambda: config_from_dict("kv_transfer_config", {"lease": 3}, KVTransferConfig),
            "unknown kv_transfer_config keys ['lease']; known: [",
        ),
    ],
)
def test_unknown_keys_are_named_with_the_known_ones(make, message: str) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(message)


def test_config_from_dict_takes_the_dataclass_itself_and_refuses_other_types() -> None:
    config = KVTransferConfig(secret="s")
    assert config_from_dict("kv_transfer_config", config, KVTransferConfig) is config
    assert config_from_dict("kv", {"secret": "t"}, KVTransferConfig).secret == "t"
    with pytest.raises(ValueError, match="kv_transfer_config must be a dict, got list"):
        config_from_dict("kv_transfer_config", ["nixl"], KVTransferConfig)


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        ({"rate": 1.5}, r"rate must be in \[0, 1\]"),
        ({"rate": True}, r"rate must be in \[0, 1\]"),
        ({"faults": "flip"}, "faults must be some of"),  # a string, not a list
        ({"faults": []}, "faults must be some of"),
        ({"faults": ["flip", "melt"]}, "faults must be some of"),
        ({"delay_s": -1}, "delay_s must be >= 0"),
        ({"rates": 0.1}, r"unknown kv_transfer_config.fault_injection keys \['rates'\]"),
        ("often", "fault_injection must be a dict"),
    ],
)
def test_fault_injection_settings_are_checked(faults, message) -> None:
    with pytest.raises(ValueError, match=message):
        KVTransferConfig(fault_injection=faults)  # type: ignore[arg-type]
    config = KVTransferConfig(fault_injection={"rate": 0.5, "faults": ["stale"], "seed": 3})
    assert config.fault_injection is not None and config.fault_injection.faults == ("stale",)


@pytest.mark.parametrize(
    "name", ["lease_seconds", "heartbeat_timeout_s", "handshake_timeout_s", "read_timeout_base_s"]
)
@pytest.mark.parametrize("value", [0, -1.5, True, "2", float("inf"), float("nan")])
def test_kv_transfer_durations_must_be_positive_numbers(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be > 0, got {value!r}$"):
        KVTransferConfig(**{name: value})  # type: ignore[arg-type]
    assert getattr(KVTransferConfig(**{name: 2}), name) == 2  # type: ignore[arg-type]
