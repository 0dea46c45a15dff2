"""The routing rule for new generate sequences (services/scheduler/prefix_routing.py): pure, a
fake clock where time matters (the memory of recently routed prefixes); then in a GeneratePool
with fake workers (tests/unit/scheduler/test_generate_pool.py's)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_pool import GeneratePool
from services.scheduler.generate_stream import GenerateStream
from services.scheduler.prefix_cache import block_hashes, tenant_salt
from services.scheduler.prefix_routing import (
    Candidate,
    RecentPrefixes,
    Route,
    Router,
    RoutingMode,
    RoutingWeights,
    WorkerLoad,
    WorkerView,
    choose_worker,
    routing_cost,
)
from services.scheduler.sequence import SamplingParams
from services.scheduler.worker_link import WorkerLink
from tests.unit.scheduler.test_generate_pool import MODEL, Reader, _settle, attach, hello
from tools.testbed.fake_clock import FakeClock


def load(num_running: int = 0, num_waiting: int = 0, max_num_seqs: int = 16, num_prefill_tokens: int = 0,
         kv_usage: float = 0.0) -> WorkerLoad:
    return WorkerLoad(num_running, num_waiting, max_num_seqs, num_prefill_tokens, kv_usage)


def cand(worker: str, cached: int = 0, **over) -> Candidate[str]:
    return Candidate(worker, cached, load(**over))


def pick(candidates: list[Candidate[str]], prompt_len: int = 600, mode: RoutingMode = RoutingMode.CACHE_AWARE,
         weights: RoutingWeights | None = None) -> str:
    return choose_worker(mode, prompt_len, candidates, random.Random(0), weights or RoutingWeights())


# -- the cost ------------------------------------------------------------------------------


def test_cost_counts_uncached_and_queued_prefill_sequences_and_overflow():
    weights = RoutingWeights(prefill_weight=2.0, sequence_weight=10.0, over_capacity_weight=100.0)
    candidate = cand("a", cached=96, num_running=3, num_waiting=1, max_num_seqs=4, num_prefill_tokens=50)
    # 2 x (104 uncached + 50 queued) + 10 x 4 sequences + 100 x 1 beyond 4 slots (the newcomer is the 5th)
    assert routing_cost(200, candidate, weights) == 2 * 154 + 40 + 100


def test_a_fully_cached_prompt_still_computes_one_token():
    assert routing_cost(64, cand("a", cached=64), RoutingWeights()) == 1.0


def test_no_slot_limit_known_means_no_overflow_term():
    assert routing_cost(10, cand("a", num_running=50, max_num_seqs=0), RoutingWeights()) == 10 + 32 * 50


def test_negative_weights_are_refused():
    with pytest.raises(ValueError, match="sequence_weight must be >= 0"):
        RoutingWeights(sequence_weight=-1)


# -- cache-aware ---------------------------------------------------------------------------


def test_goes_to_the_worker_holding_the_prefix_when_loads_are_equal():
    assert pick([cand("a", num_running=2), cand("b", cached=512, num_running=2), cand("c", num_running=2)]) == "b"


def test_the_longest_cached_prefix_wins_over_a_shorter_one():
    assert pick([cand("a", cached=256), cand("b", cached=512)]) == "b"


def test_takes_a_somewhat_busier_worker_for_its_cache():
    assert pick([cand("a", num_running=1), cand("b", cached=512, num_running=6)]) == "b"


def test_a_saturated_worker_holding_the_prefix_does_not_attract_everything():
    # Every slot taken and three waiting: the newcomer would queue behind them; an idle worker
    # recomputing 512 tokens is quicker to a first token.
    busy = cand("b", cached=512, num_running=16, num_waiting=3, max_num_seqs=16)
    assert pick([cand("a"), busy]) == "a"


def test_a_prefill_backlog_outweighs_the_cache():
    backlog = cand("b", cached=512, num_running=1, num_waiting=2, num_prefill_tokens=1200)
    assert pick([cand("a", num_running=1), backlog]) == "a"


def test_a_stream_of_one_prefix_spills_over_once_its_worker_fills():
    """Sequences of one tenant keep arriving: they stay with the cache until its worker's queue
    costs more than the prefix saves, then go to the others, never all to one."""
    running = {"a": 0, "b": 0, "c": 0}
    cached = {"a": 480, "b": 0, "c": 0}
    placed = []
    for _ in range(40):
        candidates = [cand(w, cached=cached[w], num_running=min(n, 16), num_waiting=max(0, n - 16))
                      for w, n in running.items()]
        worker = pick(candidates, prompt_len=500)
        running[worker] += 1
        cached[worker] = 480
        placed.append(worker)
    assert placed[0] == "a"
    assert set(placed) == {"a", "b", "c"}
    assert max(running.values()) - min(running.values()) <= 16


def test_ties_go_to_more_cache_then_fewer_sequences_then_lower_kv_usage_then_order():
    # Equal cost: a caches 32 more tokens but runs one more sequence (sequence_weight 32).
    assert pick([cand("b", num_running=0), cand("a", cached=32, num_running=1)]) == "a"
    assert pick([cand("b", kv_usage=0.5), cand("a", kv_usage=0.1)]) == "a"
    assert pick([cand("b"), cand("a")]) == "b"


def test_with_no_cache_anywhere_it_balances_by_load():
    assert pick([cand("a", num_running=3), cand("b", num_running=1), cand("c", num_running=2)]) == "b"


def test_no_candidates_is_an_error():
    with pytest.raises(ValueError, match="no candidate workers"):
        pick([])


# -- the other modes -------------------------------------------------------------------------


def test_least_loaded_ignores_the_cache():
    candidates = [cand("a", cached=512, num_running=2), cand("b", num_running=1, kv_usage=0.9),
                  cand("c", num_running=1, kv_usage=0.2)]
    assert pick(candidates, mode=RoutingMode.LEAST_LOADED) == "c"


def test_random_spreads_over_every_worker_whatever_their_cache():
    rng = random.Random(7)
    candidates = [cand("a", cached=512), cand("b"), cand("c")]
    counts = Counter(choose_worker(RoutingMode.RANDOM, 600, candidates, rng) for _ in range(3000))
    assert set(counts) == {"a", "b", "c"}
    assert all(900 < n < 1100 for n in counts.values())


def test_modes_parse_from_their_flag_values():
    assert [RoutingMode(v) for v in ("least_loaded", "random", "cache_aware")] == list(RoutingMode)


# -- recently routed prefixes (fake clock) ---------------------------------------------------


def test_recent_prefixes_count_leading_blocks_routed_to_that_worker_only():
    recent: RecentPrefixes[str] = RecentPrefixes(FakeClock(), ttl_s=2.0)
    recent.record("a", [11, 12, 13])
    assert recent.num_leading("a", [11, 12, 13, 14]) == 3
    assert recent.num_leading("a", [11, 99, 13]) == 1  # chained hashes: a different block ends the prefix
    assert recent.num_leading("b", [11, 12, 13]) == 0


def test_recent_prefixes_expire_after_their_ttl():
    clock = FakeClock()
    recent: RecentPrefixes[str] = RecentPrefixes(clock, ttl_s=2.0)
    recent.record("a", [11, 12])
    clock.advance(1.5)
    recent.record("a", [11])  # the first block routed again: it lives on, its successor does not
    clock.advance(1.0)
    assert recent.num_leading("a", [11, 12]) == 1
    recent.record("b", [5])  # recording prunes what expired
    assert len(recent) == 2
    clock.advance(2.0)
    assert recent.num_leading("a", [11]) == 0


def test_recent_prefixes_keep_at_most_max_entries():
    recent: RecentPrefixes[str] = RecentPrefixes(FakeClock(), ttl_s=60.0, max_entries=4)
    recent.record("a", [1, 2, 3])
    recent.record("a", [4, 5, 6])
    assert len(recent) == 4
    assert recent.num_leading("a", [1]) == 0
    assert recent.num_leading("a", [3, 4, 5, 6]) == 4


def test_recent_prefixes_forget_a_worker_that_left():
    recent: RecentPrefixes[str] = RecentPrefixes(FakeClock())
    recent.record("a", [1, 2])
    recent.record("b", [1, 2])
    recent.forget_worker("a")
    assert recent.num_leading("a", [1, 2]) == 0
    assert recent.num_leading("b", [1, 2]) == 2


def test_recent_prefixes_refuse_bad_settings():
    with pytest.raises(ValueError, match="ttl_s must be >= 0"):
        RecentPrefixes(FakeClock(), ttl_s=-1)
    with pytest.raises(ValueError, match="max_entries must be >= 1"):
        RecentPrefixes(FakeClock(), max_entries=0)


# -- the router: hashes once, asks each worker's index (fakes for the block manager) ----------


class FakeIndex:
    """A worker's resident blocks: the hashes of the prompts it computed."""

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self.resident: set[int] = set()
        self.num_queries = 0

    def num_cached_prefix_blocks(self, hashes, /) -> int:
        self.num_queries += 1
        num = 0
        for block_hash in hashes:
            if block_hash not in self.resident:
                break
            num += 1
        return num


def hasher(token_ids, block_size, tenant_id, lora_adapter=""):
    """Chained and salted by tenant, like the prefix cache's (which the pool passes in)."""
    hashes, parent = [], hash(tenant_id)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


SYSTEM = tuple(range(100, 100 + 480))  # 30 blocks of 16


def views(indexes: dict[str, FakeIndex], **loads: WorkerLoad) -> list[WorkerView[str]]:
    return [WorkerView(w, loads.get(w, load()), index) for w, index in indexes.items()]


def test_router_sends_a_prompt_to_the_worker_holding_its_tenants_prefix():
    indexes = {"a": FakeIndex(), "b": FakeIndex(), "c": FakeIndex()}
    indexes["b"].resident.update(hasher(SYSTEM, 16, "acme"))
    router: Router[str] = Router(RoutingMode.CACHE_AWARE, FakeClock(), hasher, recent_ttl_s=0)
    prompt = SYSTEM + (1, 2, 3)
    assert router.choose(prompt, "acme", views(indexes, a=load(num_running=1))) == Route("b", 480)
    # Another tenant's identical tokens are salted differently: nothing cached for it anywhere.
    assert router.choose(prompt, "globex", views(indexes, b=load(num_running=1))).worker == "a"


def test_router_keeps_a_burst_of_one_prefix_together_until_its_blocks_are_resident():
    clock = FakeClock()
    indexes = {"a": FakeIndex(), "b": FakeIndex(), "c": FakeIndex()}
    router: Router[str] = Router(RoutingMode.CACHE_AWARE, clock, hasher, recent_ttl_s=2.0)
    placed = []
    for n in range(3):
        loads = {w: load(num_running=placed.count(w)) for w in indexes}
        placed.append(router.choose(SYSTEM + (n,), "acme", views(indexes, **loads)).worker)
    assert placed == ["a", "a", "a"]
    clock.advance(2.5)  # not computed within the TTL (never, here): the memory lapses
    assert router.choose(SYSTEM, "acme", views(indexes, a=load(num_running=3))).worker == "b"


def test_router_hashes_once_per_block_size():
    calls = []

    def counting(token_ids, block_size, tenant_id, lora_adapter=""):
        calls.append(block_size)
        return hasher(token_ids, block_size, tenant_id)

    indexes = {"a": FakeIndex(16), "b": FakeIndex(16), "c": FakeIndex(32)}
    router: Router[str] = Router(RoutingMode.CACHE_AWARE, FakeClock(), counting)
    router.choose(SYSTEM, "acme", views(indexes))
    assert sorted(calls) == [16, 32]


def test_router_never_counts_the_block_of_the_last_token():
    lengths = []

    def recording(token_ids, block_size, tenant_id, lora_adapter=""):
        lengths.append(len(token_ids))
        return hasher(token_ids, block_size, tenant_id)

    router: Router[str] = Router(RoutingMode.CACHE_AWARE, FakeClock(), recording)
    router.choose(tuple(range(32)), "acme", views({"a": FakeIndex()}))
    assert lengths == [31]  # one full block: the second holds the last token, which is computed anyway


def test_router_without_a_prefix_cache_never_hashes_and_balances_by_load():
    indexes = {"a": FakeIndex(), "b": FakeIndex()}
    router: Router[str] = Router(RoutingMode.CACHE_AWARE, FakeClock(), None)
    assert router.choose(SYSTEM, "acme", views(indexes, a=load(num_running=2))).worker == "b"
    assert all(index.num_queries == 0 for index in indexes.values())


def test_router_least_loaded_and_random_never_ask_the_indexes():
    indexes = {"a": FakeIndex(), "b": FakeIndex()}
    for mode in (RoutingMode.LEAST_LOADED, RoutingMode.RANDOM):
        router: Router[str] = Router(mode, FakeClock(), hasher, rng=random.Random(1))
        assert router.choose(SYSTEM, "acme", views(indexes)).worker in indexes
    assert all(index.num_queries == 0 for index in indexes.values())


def test_router_forgets_what_it_routed_to_a_worker_that_left():
    indexes = {"a": FakeIndex(), "b": FakeIndex()}
    router: Router[str] = Router(RoutingMode.CACHE_AWARE, FakeClock(), hasher)
    assert router.choose(SYSTEM, "acme", views(indexes)).worker == "a"
    router.forget_worker("a")
    assert router.choose(SYSTEM, "acme", views(indexes, a=load(num_running=1))).worker == "b"


def test_router_refuses_an_empty_worker_list():
    router: Router[str] = Router(RoutingMode.CACHE_AWARE, FakeClock(), hasher)
    with pytest.raises(ValueError, match="no candidate workers"):
        router.choose(SYSTEM, "acme", [])


# -- in the pool: a conversation finds its earlier turns (fake workers, fake clock) -----------


def routed_pool(routing: str, **config) -> GeneratePool:
    clock = FakeClock(autojump_turns=200)  # the first step after an idle spell waits a little (StepPacing.gather)
    return GeneratePool(MODEL, hello("w0"), SchedulerConfig(routing=routing, **config), clock=clock,
                        sleep=clock.sleep)


def start(pool: GeneratePool, prompt: str, tenant_id: str, max_tokens: int) -> GenerateStream:
    stream = GenerateStream(seq_id=WorkerLink.next_id(), tenant=TenantContext(tenant_id), seed=0,
                            trace_context={}, arrival_s=pool.clock(), deadline_s=None)
    pool.submit(stream, tuple(prompt.encode()), SamplingParams(max_tokens=max_tokens))
    return stream


def ran_on(workers, stream: GenerateStream):
    """The worker that ran the finished sequence (it was told to forget it)."""
    (worker,) = [w for w in workers if stream.seq_id in w.forgotten]
    return worker


async def converse_turn(pool: GeneratePool, workers, prompt: str, tenant_id: str = "acme"):
    """Sends one turn, reads its answer; returns the answer and the worker that ran it."""
    stream = start(pool, prompt, tenant_id, max_tokens=4)
    answer = await Reader(stream).read()
    await _settle()
    return answer, ran_on(workers, stream)


@pytest.mark.parametrize("routing", ["cache_aware", "least_loaded"])
async def test_each_turn_of_a_conversation_goes_where_its_history_is_cached(routing):
    pool = routed_pool(routing)
    workers = [attach(pool, f"w{n}") for n in range(3)]
    system = "You are a helpful assistant for acme. Answer briefly. "  # 53 tokens: 13 blocks of 4
    prompt = system + "User: hi"
    answer, first = await converse_turn(pool, workers, prompt)
    places = []
    for turn in range(3):
        pool.clock.advance(10.0)  # past the recent-routing memory: only resident blocks count now
        # Another tenant's long request arrives first and, all idle, lands on the first worker (the
        # conversation's): the turn after it either follows its cached history or avoids the load.
        busy = start(pool, f"long story {turn}", "globex", max_tokens=100)
        prompt = f"{prompt}{answer}\nUser: and {turn}?"
        answer, place = await converse_turn(pool, workers, prompt)
        places.append(place)
        pool.abort(busy)
    assert first is workers[0]
    if routing == "cache_aware":
        assert places == [first] * 3
    else:
        assert first not in places


async def test_a_public_prefix_draws_every_tenant_to_the_worker_holding_it():
    public = "You are the shared assistant of every tenant here. "
    pool = routed_pool("cache_aware", public_prefixes=f'["{public}"]')
    workers = [attach(pool, f"w{n}") for n in range(3)]
    _, first = await converse_turn(pool, workers, public + "User: hi", tenant_id="acme")
    pool.clock.advance(10.0)
    busy = start(pool, "long story", "initech", max_tokens=100)  # lands on the first worker
    _, place = await converse_turn(pool, workers, public + "User: hello", tenant_id="globex")
    pool.abort(busy)
    assert first is workers[0] and place is workers[0]


async def test_waiting_turns_count_only_their_uncached_tokens_as_queued_prefill():
    """Two turns of a tenant arrive together: the first waits on the worker holding the tenant's
    prefix; the second goes there too, because what waits ahead of it is the first's 5 uncached
    tokens, not its 65 (counted whole, the idle worker would look cheaper)."""
    pool = routed_pool("cache_aware")
    workers = [attach(pool, f"w{n}") for n in range(2)]
    system = "You are a helpful assistant for acme. Answer briefly. Be kind. "  # 63 tokens
    _, first = await converse_turn(pool, workers, system + "hi")
    pool.clock.advance(10.0)  # only resident blocks count
    # Submitted back to back: neither is computed when the other is routed.
    streams = [start(pool, system + question, "acme", max_tokens=2) for question in ("a?", "b?")]
    for stream in streams:
        await Reader(stream).read()
    await _settle()
    assert [ran_on(workers, stream) for stream in streams] == [first, first]


async def test_the_hashes_routing_passes_on_are_those_the_step_scheduler_would_compute():
    pool = routed_pool("cache_aware")
    attach(pool, "w0")
    prompt = "You are a helpful assistant for acme. Answer briefly. "
    stream = start(pool, prompt, "acme", max_tokens=2)
    assert stream.seq is not None
    tokens = stream.seq.token_ids(0, stream.seq.num_tokens)
    expected = block_hashes(tokens[:-1], hello("w0").capacity.block_size, tenant_salt("acme"))
    assert expected and stream.seq.block_hashes == expected
    await Reader(stream).read()
