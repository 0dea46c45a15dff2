"""Gateway configuration (flags / INFERMESH_GATEWAY_* variables)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ConfigError, ServerSettings, require, setting
from services.common.objectives import LatencyObjective, ObjectiveBounds, ObjectivePolicy
from services.common.priority import Priority
from services.common.scheduler_address import SchedulerAddress, SchedulerAddressError, parse_scheduler_address
from services.gateway.admission.adaptive_limit import AdaptiveLimitConfig
from services.gateway.admission.shedding import SheddingConfig, ShedThresholds
from services.gateway.dispatch.deadlines import DeadlinePolicy
from services.gateway.dispatch.retry_budget import RetryBudgetConfig
from services.gateway.dispatch.retry_policy import RetryPolicyConfig
from services.gateway.quota.lease import LeaseConfig
from services.gateway.quota.store_address import parse_store_address
from services.gateway.routing.circuit_breaker import BreakerConfig

# Fail closed: a gateway that would serve everyone must have been asked to (docs/security.md).
NO_TENANTS_MESSAGE = ("no tenants file: the gateway refuses to serve unauthenticated callers; give --tenants-file "
                      "(INFERMESH_GATEWAY_TENANTS_FILE), or --allow-anonymous to admit everyone (development only)")


@dataclass(frozen=True)
class GatewayConfig(ServerSettings):
    scheduler_address: str = setting(
        "127.0.0.1:50052",
        "schedulers serving models without a route: host:port[,host:port...] or dns:///name:port "
        "(every A/AAAA record, re-resolved every discovery_interval_ms)",
    )
    discovery_interval_ms: float = setting(5000.0, "how often a dns:/// scheduler_address is re-resolved")
    drain_notice_ms: float = setting(
        1000.0, "on SIGTERM, how long to go on serving new calls after health turns NOT_SERVING and before the "
        "server stops (GOAWAY): clients with client-side health checking (docs/operations.md) move their "
        "new calls to another gateway meanwhile, so none reaches this one as it stops (grpc/grpc#41785); it then "
        "serves on until the calls grpc queued before are handed over (at most drain_grace_s less 1 s)",
        minimum=0)
    silence_probe_after_ms: float = setting(
        300.0, "a scheduler that sent nothing this long while calls wait on it is probed; 0: never"
    )
    silence_probe_timeout_ms: float = setting(
        300.0, "a probed scheduler that does not answer within this is severed: its calls fail over"
    )
    http_port: int = setting(
        0, "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) on the "
        "gateway's host, HTTPS when the gRPC port serves TLS; 0: off (docs/clients.md)"
    )
    enable_tokenizer_info_endpoint: bool = setting(
        False, "serve vLLM's GET /tokenizer_info on the HTTP port: a generator's tokenizer configuration, its chat "
        "template included (vLLM serves it only behind this flag, as the template may be the model owner's to keep)")
    http_cors_origins: tuple[str, ...] = setting(
        (), "origins whose browser pages may call the HTTP port (CORS), e.g. https://chat.example.com; * for any "
        "(callers bring API keys, not cookies); none: no CORS headers, and a browser's preflight is refused")
    # Stored Responses (services/gateway/fronts/response_store.py, docs/clients.md "Stored responses").
    responses_store_bytes: int = setting(
        0, "memory this gateway keeps OpenAI Responses and Conversations in (POST /v1/responses with store, then "
        "previous_response_id, GET / DELETE /v1/responses/{id}; /v1/conversations), bytes of their JSON (in Python up to ~6x that for short texts); the least "
        "recently used go first when full; "
        "0: off, nothing is stored and previous_response_id and conversation are 400s", minimum=0)
    responses_store_ttl_s: float = setting(
        3600.0, "how long a stored Response is kept after it was answered, and a Conversation after its last change, "
        "read or not")
    routing_file: str = setting("", "routing YAML (models: name -> versions -> scheduler endpoints); empty: all to scheduler_address")
    # Rollouts (services/gateway/rollout/controller.py, docs/operations.md "Rollouts").
    rollout_state_file: str = setting(
        "", "JSON file where the rollout decider keeps each rollout's step and decisions (and the others read them); "
        "empty: in memory only")
    rollout_role: str = setting(
        "decider", "decider: this gateway judges the canaries and writes --rollout-state-file; follower: it applies "
        "what the file says (run exactly one decider)")
    rollout_interval_ms: float = setting(500.0, "how often the rollouts are judged (the decider) or re-read (followers)")
    shadow_timeout_ms: float = setting(5000.0, "deadline of a mirrored (shadow) call")
    upstream_mode: str = setting(
        "stream", "how calls reach a scheduler: stream (one Submit stream per endpoint, many calls per message) or unary (an RPC per call)"
    )
    default_deadline_ms: float = setting(30_000.0, "deadline applied when the client sets none")
    max_deadline_ms: float = setting(300_000.0, "client deadlines are clamped to this")
    hop_margin_ms: float = setting(5.0, "time kept back from the deadline passed to the scheduler")
    tenants_file: str = setting("", "tenant/API-key YAML; required unless allow_anonymous")
    allow_anonymous: bool = setting(
        False, "with no tenants_file, admit every caller as tenant 'anonymous' (development only; warned at start)"
    )
    trust_trace_context: str = setting(
        "none", "whose W3C traceparent a request's trace follows: none (the gateway samples; the sent one is a link), "
        "all (a trusted proxy in front), or tenants (those marked trust_trace_context in the tenants file)"
    )
    tenants_poll_interval_ms: float = setting(1000.0, "how often the tenants file is checked for changes; 0: only on SIGHUP")
    # Quotas across gateways (services/gateway/quota/lease.py, docs/gateway.md).
    quota_store_address: str = setting(
        "", "Valkey/Redis host:port shared by all gateways for tenant quotas, or sentinel://host:port[,host:port...]/name "
        "(Valkey Sentinel: the current primary of name); empty: each gateway enforces the full quota alone"
    )
    quota_store_prefix: str = setting("infermesh:quota:", "namespace of the quota keys in the store")
    quota_lease_interval_ms: float = setting(100.0, "how often quota slices are leased from and returned to the store")
    quota_store_ttl_ms: float = setting(
        1000.0, "a gateway that has not synced for this long counts as gone (its in-flight slots free up)"
    )
    quota_expected_gateways: int = setting(
        1, "gateway replicas assumed until the store has reported how many are alive (the fallback divisor)"
    )
    gateway_id: str = setting("", "this gateway's name in the quota store; empty: host:pid:random")
    max_in_flight: int = setting(1024, "gateway-wide cap on requests in flight; beyond it UNAVAILABLE at once")
    # Adaptive concurrency limit per model (services/gateway/admission/adaptive_limit.py).
    limit_initial: int = setting(64, "each model's adaptive concurrency limit before anything was measured")
    limit_min: int = setting(4, "the adaptive limit never falls below this")
    limit_max: int = setting(2048, "the adaptive limit never grows above this")
    limit_tolerance: float = setting(1.5, "latency may grow to this multiple of its baseline before the limit shrinks")
    limit_late_fraction: float = setting(0.5, "a request that used more of its deadline than this counts as late")
    limit_share: tuple[float, ...] = setting(
        (1.0, 0.9, 0.6), "fraction of the limit critical,standard,sheddable traffic may fill"
    )
    # Retries (gRPC A6-style backoff, Finagle-style budget per scheduler endpoint).
    retry_max_attempts: int = setting(3, "attempts per request, the first included")
    retry_initial_backoff_ms: float = setting(25.0, "backoff cap after the first failed attempt (full jitter)")
    retry_max_backoff_ms: float = setting(500.0, "largest backoff cap")
    retry_budget_ratio: float = setting(0.1, "retries allowed per original request, over the budget window")
    retry_budget_window_s: float = setting(10.0, "retry budget sliding window")
    retry_budget_min_per_s: float = setting(1.0, "retries per second always allowed, even when quiet")
    stream_max_resumes: int = setting(
        3, "times one Generate stream may be resumed on another scheduler after its upstream broke mid-stream"
    )
    hold_max_calls: int = setting(
        512, "calls held at most at once while no scheduler can take them (every circuit open, every scheduler gone, "
        "restarting or silent): held idempotent calls and resumable streams go again as soon as one can, within their "
        "deadline; beyond this UNAVAILABLE at once; 0: hold nothing (docs/operations.md)", minimum=0)
    # Circuit breaker per scheduler endpoint.
    breaker_consecutive_failures: int = setting(5, "failures in a row that open the breaker")
    breaker_error_rate: float = setting(0.5, "error rate over the window that opens the breaker, (0, 1]")
    breaker_window_s: float = setting(10.0, "error-rate window")
    breaker_min_calls: int = setting(20, "calls in the window before the error rate counts")
    breaker_open_cooldown_ms: float = setting(5000.0, "how long an open breaker fails calls fast before a probe")
    # Load shedding.
    shed_queue_slo_ms: tuple[float, ...] = setting(
        (500.0, 2000.0, 5000.0), "queue-time SLO of critical,standard,sheddable traffic"
    )
    shed_queue_at: tuple[float, ...] = setting(
        (0.5, 0.8), "critical queue time / its SLO at which sheddable, then standard, are shed"
    )
    shed_kv_usage_at: tuple[float, ...] = setting((0.90, 0.97), "KV usage at which sheddable, then standard, are shed")
    shed_in_flight_at: tuple[float, ...] = setting(
        (0.8, 0.9), "gateway in-flight / max_in_flight at which sheddable, then standard, are shed"
    )
    # Latency objectives of Generate (services/common/objectives.py, docs/gateway.md "Latency objectives").
    slo_ttft_ms: tuple[float, ...] = setting(
        (1000.0, 2000.0, 10_000.0), "time-to-first-token target of critical,standard,sheddable streams")
    slo_tpot_ms: tuple[float, ...] = setting(
        (100.0, 200.0, 1000.0), "time-per-output-token target of critical,standard,sheddable streams")
    slo_ttft_bounds_ms: tuple[float, ...] = setting(
        (10.0, 600_000.0), "min,max TTFT target a tenant or request may set (outside: INVALID_ARGUMENT)")
    slo_tpot_bounds_ms: tuple[float, ...] = setting(
        (1.0, 60_000.0), "min,max TPOT target a tenant or request may set (outside: INVALID_ARGUMENT)")
    slo_admission: bool = setting(
        True, "refuse a Generate whose TTFT target no scheduler is predicted to meet (false: deadlines alone)")
    slo_calibration: bool = setting(
        True, "multiply each class's predicted TTFT by the measured / predicted ratio learned from its served streams")
    slo_admit_quantile: float = setting(
        0.95, "with slo_calibration, admit a Generate when this quantile of its predicted TTFT meets its target "
        "(0.5: the median)")
    pressure_poll_interval_ms: float = setting(1000.0, "how often every scheduler's GetPressure is polled")
    pressure_max_age_ms: float = setting(5000.0, "pressure reports older than this are ignored (fail open)")

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            parse_scheduler_address(self.scheduler_address)
        except SchedulerAddressError as exc:
            require(False, f"scheduler_address must be host:port, got {self.scheduler_address!r} ({exc})")
        require(0 <= self.http_port <= 65535, f"http_port must be 0..65535, got {self.http_port}")
        for origin in self.http_cors_origins:
            require(origin == "*" or (origin.startswith(("http://", "https://")) and origin.count("/") == 2),
                    f"http_cors_origins: each is * or scheme://host[:port] with no path, got {origin!r}")
        require(self.responses_store_ttl_s > 0, f"responses_store_ttl_s must be > 0, got {self.responses_store_ttl_s}")
        require(self.discovery_interval_ms > 0, f"discovery_interval_ms must be > 0, got {self.discovery_interval_ms}")
        require(self.silence_probe_after_ms >= 0,
                f"silence_probe_after_ms must be >= 0, got {self.silence_probe_after_ms}")
        require(self.silence_probe_timeout_ms > 0,
                f"silence_probe_timeout_ms must be > 0, got {self.silence_probe_timeout_ms}")
        require(self.stream_max_resumes >= 0, f"stream_max_resumes must be >= 0, got {self.stream_max_resumes}")
        require(self.upstream_mode in ("stream", "unary"),
                f"upstream_mode must be stream or unary, got {self.upstream_mode!r}")
        require(self.default_deadline_ms > 0, f"default_deadline_ms must be > 0, got {self.default_deadline_ms}")
        require(
            self.max_deadline_ms >= self.default_deadline_ms,
            f"max_deadline_ms ({self.max_deadline_ms}) must be >= default_deadline_ms ({self.default_deadline_ms})",
        )
        require(self.hop_margin_ms >= 0, f"hop_margin_ms must be >= 0, got {self.hop_margin_ms}")
        require(self.trust_trace_context in ("none", "all", "tenants"),
                f"trust_trace_context must be none, all or tenants, got {self.trust_trace_context!r}")
        require(self.rollout_role in ("decider", "follower"),
                f"rollout_role must be decider or follower, got {self.rollout_role!r}")
        require(self.rollout_interval_ms > 0, f"rollout_interval_ms must be > 0, got {self.rollout_interval_ms}")
        require(self.shadow_timeout_ms > 0, f"shadow_timeout_ms must be > 0, got {self.shadow_timeout_ms}")
        require(self.rollout_role == "decider" or bool(self.rollout_state_file),
                "rollout_role follower needs rollout_state_file (the decider's state to follow)")
        require(self.tenants_poll_interval_ms >= 0,
                f"tenants_poll_interval_ms must be >= 0, got {self.tenants_poll_interval_ms}")
        if self.quota_store_address:
            try:
                parse_store_address(self.quota_store_address)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        require(self.quota_store_ttl_ms >= 2 * self.quota_lease_interval_ms,
                f"quota_store_ttl_ms ({self.quota_store_ttl_ms}) must be >= 2 x quota_lease_interval_ms "
                f"({self.quota_lease_interval_ms}), or live gateways expire between their syncs")
        require(self.max_in_flight >= 1, f"max_in_flight must be >= 1, got {self.max_in_flight}")
        require(self.pressure_poll_interval_ms > 0,
                f"pressure_poll_interval_ms must be > 0, got {self.pressure_poll_interval_ms}")
        require(self.pressure_max_age_ms > 0, f"pressure_max_age_ms must be > 0, got {self.pressure_max_age_ms}")
        require(len(self.shed_queue_slo_ms) == 3,
                f"shed_queue_slo_ms needs 3 values (critical,standard,sheddable), got {self.shed_queue_slo_ms}")
        require(len(self.limit_share) == 3,
                f"limit_share needs 3 values (critical,standard,sheddable), got {self.limit_share}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            require(len(value) == 3, f"{name} needs 3 values (critical,standard,sheddable), got {value}")
        for name in ("slo_ttft_bounds_ms", "slo_tpot_bounds_ms"):
            value = getattr(self, name)
            require(len(value) == 2, f"{name} needs 2 values (min,max), got {value}")
        require(0.5 <= self.slo_admit_quantile < 1,
                f"slo_admit_quantile must be in [0.5, 1), got {self.slo_admit_quantile}")
        for name in ("shed_queue_at", "shed_kv_usage_at", "shed_in_flight_at"):
            value = getattr(self, name)
            require(len(value) == 2, f"{name} needs 2 values (sheddable,standard), got {value}")
        # The logic modules validate their own ranges; surface their messages as config errors.
        for build in (self.lease_config, self.deadline_policy, self.retry_policy_config, self.retry_budget_config,
                      self.breaker_config, self.shedding_config, self.limit_config, self.objective_policy):
            try:
                build()
            except ValueError as exc:
                require(False, str(exc))
        # Last, so a gateway with other mistakes too hears of those first.
        require(bool(self.tenants_file) or self.allow_anonymous, NO_TENANTS_MESSAGE)

    # -- the logic modules' configs, in their units ---------------------------------

    def scheduler_target(self) -> SchedulerAddress:
        return parse_scheduler_address(self.scheduler_address)

    def lease_config(self) -> LeaseConfig:
        return LeaseConfig(interval_s=self.quota_lease_interval_ms / 1000,
                           expected_gateways=self.quota_expected_gateways)

    def deadline_policy(self) -> DeadlinePolicy:
        return DeadlinePolicy(
            default_timeout_s=self.default_deadline_ms / 1000,
            max_timeout_s=self.max_deadline_ms / 1000,
            hop_margin_s=self.hop_margin_ms / 1000,
        )

    def limit_config(self) -> AdaptiveLimitConfig:
        critical, standard, sheddable = self.limit_share
        return AdaptiveLimitConfig(
            initial_limit=self.limit_initial,
            min_limit=self.limit_min,
            max_limit=self.limit_max,
            tolerance=self.limit_tolerance,
            late_fraction=self.limit_late_fraction,
            share={Priority.CRITICAL: critical, Priority.STANDARD: standard, Priority.SHEDDABLE: sheddable},
        )

    def objective_policy(self) -> ObjectivePolicy:
        (min_ttft_ms, max_ttft_ms), (min_tpot_ms, max_tpot_ms) = self.slo_ttft_bounds_ms, self.slo_tpot_bounds_ms
        return ObjectivePolicy(
            by_priority={p: LatencyObjective(ttft_ms, tpot_ms)
                         for p, ttft_ms, tpot_ms in zip(Priority, self.slo_ttft_ms, self.slo_tpot_ms, strict=True)},
            bounds=ObjectiveBounds(min_ttft_ms, max_ttft_ms, min_tpot_ms, max_tpot_ms),
        )

    def retry_policy_config(self) -> RetryPolicyConfig:
        return RetryPolicyConfig(
            max_attempts=self.retry_max_attempts,
            initial_backoff_s=self.retry_initial_backoff_ms / 1000,
            max_backoff_s=self.retry_max_backoff_ms / 1000,
        )

    def retry_budget_config(self) -> RetryBudgetConfig:
        return RetryBudgetConfig(
            retry_ratio=self.retry_budget_ratio,
            window_s=self.retry_budget_window_s,
            min_retries_per_s=self.retry_budget_min_per_s,
        )

    def breaker_config(self) -> BreakerConfig:
        return BreakerConfig(
            num_consecutive_failures_to_open=self.breaker_consecutive_failures,
            error_rate_to_open=self.breaker_error_rate,
            error_rate_window_s=self.breaker_window_s,
            min_calls_in_window=self.breaker_min_calls,
            open_cooldown_s=self.breaker_open_cooldown_ms / 1000,
        )

    def shedding_config(self) -> SheddingConfig:
        critical_ms, standard_ms, sheddable_ms = self.shed_queue_slo_ms
        return SheddingConfig(
            queue_slo_s={
                Priority.CRITICAL: critical_ms / 1000,
                Priority.STANDARD: standard_ms / 1000,
                Priority.SHEDDABLE: sheddable_ms / 1000,
            },
            queue=ShedThresholds(*self.shed_queue_at),
            kv_usage=ShedThresholds(*self.shed_kv_usage_at),
            gateway_in_flight=ShedThresholds(*self.shed_in_flight_at),
        )
