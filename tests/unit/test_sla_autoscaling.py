"""The P/D-aware autoscaling policy's decisions, from synthetic metrics."""

from __future__ import annotations

import pytest
from ray.serve.config import AutoscalingContext

from deployments.app import build_app
from deployments.app_config import AppConfig
from deployments.cluster.sla_autoscaling import (
    PDAutoscalingPolicy,
    RecentLatencies,
    RoleLoad,
    SLOTargets,
    autoscaling_config,
    desired_replicas,
    latency_window_s,
)

SLO = SLOTargets(ttft_s=1.0, queued_prompt_tokens=1000, tpot_s=0.1, running_requests=10)


@pytest.mark.parametrize(
    ("load", "current", "want"),
    [
        (RoleLoad(ttft_s=[2.0, 1.0]), 2, 3),  # mean TTFT 1.5x its target: half as many more
        (RoleLoad(queued_prompt_tokens=[3000.0]), 1, 3),  # 3x the queue one replica may hold
        (RoleLoad(ttft_s=[0.9], queued_prompt_tokens=[100.0]), 1, 1),  # close: hold
        (RoleLoad(ttft_s=[0.1, 0.1], queued_prompt_tokens=[0.0, 0.0]), 2, 1),  # idle: shrink
        (RoleLoad(), 3, 3),  # nothing reported yet: hold
        (RoleLoad(tpot_s=[5.0]), 1, 1),  # a decode signal does not move the prefill role
    ],
)
def test_prefill_scales_on_ttft_and_queued_prompt_tokens(load, current, want):
    assert desired_replicas("prefill", load, SLO, current) == want


@pytest.mark.parametrize(
    ("load", "current", "want"),
    [
        (RoleLoad(tpot_s=[0.25]), 1, 3),  # 2.5x the TPOT target
        (RoleLoad(kv_cache_usage=[0.95, 0.9], tpot_s=[0.05, 0.05]), 2, 3),  # KV nearly full
        (RoleLoad(running_requests=[18.0, 17.0]), 2, 4),  # 35 running, 20 fit at target
        (RoleLoad(running_requests=[1.0, 0.0], kv_cache_usage=[0.1, 0.0]), 2, 1),
        (RoleLoad(running_requests=[0.0], kv_cache_usage=[0.0]), 1, 1),  # never below one
        (RoleLoad(tpot_s=[0.08], running_requests=[6.0]), 2, 2),
    ],
)
def test_decode_scales_on_tpot_kv_usage_and_running_requests(load, current, want):
    assert desired_replicas("decode", load, SLO, current) == want


def context(metrics: dict, current: int) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=None,  # type: ignore[arg-type]
        deployment_name="DecodeServer",
        app_name="pdserve",
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=[],
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=None,
    )


def test_the_serve_policy_reads_the_replicas_custom_metrics():
    policy = PDAutoscalingPolicy("decode", tpot_s=0.1, running_requests=10)
    metrics = {"tpot_s": {"r1": 0.3, "r2": 0.1}, "running_requests": {"r1": 4, "r2": 4}}
    assert policy(context(metrics, 2)) == (4, {})  # mean TPOT 0.2: twice the target
    assert policy(context({}, 2)) == (2, {})


def test_bad_specs_are_refused_where_they_are_written():
    with pytest.raises(ValueError, match="role"):
        PDAutoscalingPolicy("router")
    with pytest.raises(ValueError, match="tpot_s"):
        autoscaling_config("decode", {"tpot_s": 0})
    with pytest.raises(ValueError, match="unknown key"):
        autoscaling_config("decode", {"tpot": 0.1})
    with pytest.raises(ValueError, match="replaces"):
        AppConfig.from_args({"sla_autoscaling": {}, "decode_autoscaling": {"max_replicas": 2}})
    with pytest.raises(ValueError, match="min_replicas"):
        AppConfig.from_args({"sla_autoscaling": {"min_replicas": 0}})
    with pytest.raises(ValueError, match="look_back_period_s"):
        autoscaling_config("decode", {"look_back_period_s": 10})  # not over the 10 s reports


@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")
def test_the_app_puts_the_policy_in_each_roles_autoscaling_config():
    config = AppConfig.from_args(
        {"sla_autoscaling": {"tpot_s": 0.05, "max_replicas": 3, "metrics_interval_s": 2}}
    )
    decode = config.autoscaling("decode")
    assert decode is not None and decode["max_replicas"] == 3
    assert decode["metrics_interval_s"] == 2 and decode["look_back_period_s"] == 30
    assert decode["policy"]["policy_kwargs"] == {"role": "decode", "tpot_s": 0.05}
    prefill = config.autoscaling("prefill")
    assert prefill is not None and prefill["policy"]["policy_kwargs"]["role"] == "prefill"
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**decode)  # Serve accepts it as is


def test_replicas_average_latencies_over_serves_look_back():
    assert latency_window_s({"look_back_period_s": 3, "metrics_interval_s": 1}) == 3
    assert latency_window_s({"tpot_s": 0.1}) == latency_window_s(None) == 30  # Serve's default
    app = build_app({"model": "tiny", "sla_autoscaling": {"look_back_period_s": "40"}})
    engines = [a for a in app._bound_deployment.init_args if hasattr(a, "_bound_deployment")]
    assert {e._bound_deployment.name for e in engines} == {"PrefillServer", "DecodeServer"}
    assert all(e._bound_deployment.init_kwargs["latency_window_s"] == 40 for e in engines)


def test_recent_latencies_forget_requests_older_than_the_window():
    clock = [100.0]
    window = RecentLatencies(window_s=30, clock=lambda: clock[0])
    window.observe(1.0, 0.1)
    window.observe(3.0, None)
    assert window.means() == {"ttft_s": 2.0, "tpot_s": 0.1}
    clock[0] = 131.0
    assert window.means() == {}


def test_recent_latencies_stay_bounded_when_nobody_reads_them():
    clock = [0.0]
    window = RecentLatencies(window_s=30, clock=lambda: clock[0])
    for i in range(1000):
        clock[0] = float(i)
        window.observe(0.5, 0.05)
    assert len(window._ttft) == len(window._tpot) == 31  # the last 30 s, not all 1000
