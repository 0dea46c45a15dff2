"""The shared quota store: Valkey (or Redis), one Lua script per sync, atomic across gateways.

Keys, under a prefix (`--quota-store-prefix`, default "infermesh:quota:"):
  <prefix>gateways                  sorted set: gateway id -> expiry (store clock, ms)
  <prefix>t:<tenant>:requests       hash {level, ts_ms, d:<gateway id> = "demand:expiry_ms"}:
                                    the tenant's shared requests/s bucket
  <prefix>t:<tenant>:tokens         the same for its tokens/s bucket
  <prefix>t:<tenant>:in_flight      hash: gateway id -> "lease:desire:expiry_ms" (slots held)
An absent bucket is a full one, so the store may be flushed or restarted at the cost of one
burst. Every key carries a TTL, so a store that gateways stopped using empties itself.

The script reads the store's clock (TIME), never the gateways', so their clocks may disagree.
It trusts nothing it reads: a key of the wrong type is deleted, a value that is not a finite
number >= 0 is treated as an empty bucket (never a full one) and reported back, a level above
the burst is capped, an in-flight entry that is unparsable, above the tenant's quota, or expires
later than any gateway could have set, is deleted. So garbage can make a tenant wait, never let
it past its configured quota. Keys of tenants the gateway does not know are never read
(`audit()` finds and reports them).

The script declares every key it touches (KEYS), so it runs on a single Valkey/Redis; on a
cluster all of a gateway's keys would need one hash slot (a `{...}` tag in the prefix).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable

from services.gateway.quota.lease import LeasePlan, LeaseReply, TenantGrant
from services.gateway.quota.store_address import parse_store_address

DEFAULT_PREFIX = "infermesh:quota:"

_SYNC_SCRIPT = r"""
local gateway_id = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
-- Per tenant: {requests_per_s, requests_burst, return, want, floor, tokens_per_s, tokens_burst,
-- return, want, floor, max_in_flight, num_in_flight, want_in_flight}, in KEYS order.
local asks = cjson.decode(ARGV[3])
local rotation_ms = tonumber(ARGV[4])
-- A gateway shutting down: it gives its slices back, frees its slots and deregisters now
-- rather than when its TTL runs out.
local leaving = ARGV[5] == '1'
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- The store's time by which the gateway still waits for this reply; 0: no deadline. A sync that
-- runs later (a hung store resuming the scripts queued in its sockets) changes nothing: its
-- gateway gave up and fell back, so slices taken now would be used and given back by nobody.
local deadline_ms = tonumber(ARGV[6]) or 0
if deadline_ms > 0 and now_ms > deadline_ms then
  return {'late', now_ms}
end
local bad = {}

local function number_or_nil(value)
  local n = tonumber(value)
  -- NaN is the only value not equal to itself; infinities are not quotas either.
  if n == nil or n ~= n or n == math.huge or n == -math.huge or n < 0 then return nil end
  return n
end

-- A command on a key of the wrong type fails; the key is replaced, never trusted.
local function read(command, key, ...)
  local ok, reply = pcall(redis.call, command, key, ...)
  if ok then return reply end
  local kind = redis.call('TYPE', key).ok
  redis.call('DEL', key)
  table.insert(bad, key .. ' (a ' .. kind .. ', expected a ' .. (command == 'ZCARD' and 'zset' or 'hash') .. ')')
  return nil
end

-- Registry of live gateways.
local registry = KEYS[1]
read('ZCARD', registry)
redis.call('ZREMRANGEBYSCORE', registry, '-inf', now_ms)
-- No gateway sets an expiry further out than ttl_ms: such members are foreign.
local foreign = redis.call('ZRANGEBYSCORE', registry, '(' .. (now_ms + ttl_ms), '+inf')
for _, member in ipairs(foreign) do
  redis.call('ZREM', registry, member)
  table.insert(bad, registry .. ' member ' .. member .. ' (expiry too far ahead)')
end
if leaving then
  redis.call('ZREM', registry, gateway_id)
else
  redis.call('ZADD', registry, now_ms + ttl_ms, gateway_id)
  redis.call('PEXPIRE', registry, 2 * ttl_ms)
end
-- Fair shares of in-flight slots: floor(max / live) each, and the remainder one slot each to
-- the first gateways in id order, an order that rotates every rotation_ms so no gateway is
-- always the one left out. They add up to the quota, so every gateway can get its share.
local members = redis.call('ZRANGE', registry, 0, -1)
table.sort(members)
local live = math.max(1, #members)
local rank = {}
local rotation = math.floor(now_ms / rotation_ms) % live
for i, member in ipairs(members) do rank[member] = (i - 1 - rotation) % live end

-- A bucket's hash: level, ts_ms, and per gateway 'd:<id>' = "demand:expiry_ms" (what it wanted
-- at its last sync), so that idle gateways take headroom only out of what no one else wants.
local function lease_bucket(key, rate_per_s, burst, returned, wanted, floor, whole)
  local entries = read('HGETALL', key)
  local level = 0  -- a key of the wrong type is an empty bucket, never a full one
  local others_wanted = 0
  if entries ~= nil and #entries == 0 then
    level = burst  -- absent: a bucket nobody drew from lately is full
  elseif entries ~= nil then
    local stored_level, stored_ms
    for i = 1, #entries, 2 do
      local name, value = entries[i], entries[i + 1]
      if name == 'level' then
        stored_level = number_or_nil(value)
      elseif name == 'ts_ms' then
        stored_ms = number_or_nil(value)
      elseif name ~= 'd:' .. gateway_id then
        local holder = string.match(name, '^d:(.+)$')
        local demand, expiry = string.match(value, '^([^:]+):(%d+)$')
        demand, expiry = number_or_nil(demand), tonumber(expiry)
        if holder == nil or demand == nil or expiry == nil or demand > burst or expiry > now_ms + ttl_ms then
          redis.call('HDEL', key, name)
          table.insert(bad, key .. ' field ' .. name .. ' (not d:<gateway> = demand:expiry within the quota)')
        elseif expiry <= now_ms then
          redis.call('HDEL', key, name)
        else
          others_wanted = others_wanted + demand
        end
      end
    end
    if stored_level == nil or stored_ms == nil then
      table.insert(bad, key .. ' (level/ts_ms not numbers >= 0)')
    else
      level = math.min(burst, stored_level + math.max(0, now_ms - stored_ms) * rate_per_s / 1000)
    end
  end
  level = math.min(burst, level + returned)
  local granted = math.min(wanted, level)
  -- Headroom only out of what is left once the others' demand is served.
  local spare = level - granted - others_wanted
  if floor > granted and spare > 0 then
    granted = granted + math.min(floor - granted, spare)
  end
  -- Requests are leased whole: fractions stay in the bucket, where they add up, instead of
  -- spread over gateways that can each admit nothing with them.
  if whole then granted = math.floor(granted) end
  granted = math.max(0, granted)
  level = level - granted
  redis.call('HSET', key, 'level', tostring(level), 'ts_ms', tostring(now_ms))
  if wanted > 0 and not leaving then
    redis.call('HSET', key, 'd:' .. gateway_id, tostring(wanted) .. ':' .. string.format('%d', now_ms + ttl_ms))
  else
    redis.call('HDEL', key, 'd:' .. gateway_id)
  end
  -- Gone once it would have refilled: an absent bucket is a full one. At most a day, so that a
  -- tenant with a tiny rate does not leave keys behind for years (a day later it reads as full,
  -- which for such a rate is at most one burst).
  redis.call('PEXPIRE', key, math.min(86400000, math.ceil((burst - level) / rate_per_s * 1000) + ttl_ms))
  return granted
end

local function lease_slots(key, max_in_flight, num_in_flight, wanted)
  if leaving then
    redis.call('HDEL', key, gateway_id)
    return 0
  end
  local entries = read('HGETALL', key) or {}
  local base, extra = math.floor(max_in_flight / live), max_in_flight % live
  local function fair(holder)
    local r = rank[holder]
    if r ~= nil and r < extra then return base + 1 end
    return base
  end
  -- others_entitled: what the others want, each counted up to its fair share.
  local others_held, others_wanted, others_entitled = 0, 0, 0
  for i = 1, #entries, 2 do
    local holder, value = entries[i], entries[i + 1]
    if holder ~= gateway_id then
      local held, desire, expiry = string.match(value, '^(%d+):(%d+):(%d+)$')
      held, desire, expiry = tonumber(held), tonumber(desire), tonumber(expiry)
      if held == nil or held > max_in_flight or desire > max_in_flight or expiry > now_ms + ttl_ms then
        redis.call('HDEL', key, holder)
        table.insert(bad, key .. ' field ' .. holder .. ' (not lease:desire:expiry within the quota)')
      elseif expiry <= now_ms then
        redis.call('HDEL', key, holder)  -- its gateway stopped renewing: the slots are free
      else
        others_held = others_held + held
        others_wanted = others_wanted + desire
        others_entitled = others_entitled + math.min(desire, fair(holder))
      end
    end
  end
  -- Never more than the others leave free: the bound that holds whatever the rest decides.
  local free = math.max(0, max_in_flight - others_held)
  local granted
  if others_wanted + wanted > max_in_flight then
    -- Contended: what the others are entitled to (their wants up to a fair share) is theirs;
    -- those above it shrink as their requests end.
    granted = math.min(wanted, free, math.max(fair(gateway_id), max_in_flight - others_entitled))
  else
    -- Not contended: what it wants plus an even share of the slots nobody wants, as headroom for
    -- a burst before the next sync (one gateway alone may fill the whole quota at once).
    granted = math.min(free, wanted + math.floor((max_in_flight - others_wanted - wanted) / live))
  end
  local held = math.max(granted, num_in_flight)
  redis.call('HSET', key, gateway_id, string.format('%d:%d:%d', held, wanted, now_ms + ttl_ms))
  redis.call('PEXPIRE', key, 2 * ttl_ms)
  return granted
end

local grants = {}
for i, n in ipairs(asks) do
  local k = 3 * i - 1
  table.insert(grants, lease_bucket(KEYS[k], n[1], n[2], n[3], n[4], n[5], true))
  table.insert(grants, lease_bucket(KEYS[k + 1], n[6], n[7], n[8], n[9], n[10], false))
  table.insert(grants, lease_slots(KEYS[k + 2], n[11], n[12], n[13]))
end
-- One JSON string, not a reply array (which would turn fractions into integers, and cost the
-- client a parse per element); the store's time, for the gateway's next deadline.
return {live, bad, cjson.encode(grants), now_ms}
"""

_GATEWAY_KEY = "gateways"
_TENANT_KEY = re.compile(r"^t:(?P<tenant>[A-Za-z0-9][A-Za-z0-9._-]{0,63}):(?P<kind>requests|tokens|in_flight)$")


class StoreReplyError(RuntimeError):
    """The store answered something that is not the sync script's reply (treated as unreachable)."""


class LateSync(StoreReplyError):
    """The store ran the sync after this gateway's deadline for it, and leased nothing."""

    def __init__(self, store_now_ms: float) -> None:
        super().__init__("the store ran this sync after this gateway's deadline for it; it leased nothing")
        self.store_now_ms = store_now_ms


class ValkeyQuotaStore:
    """Runs a LeasePlan as one atomic script; a failure raises (the caller falls back)."""

    def __init__(
        self, address: str, prefix: str, *, gateway_id: str, ttl_s: float, timeout_s: float,
        share_rotation_s: float = 10.0, clock_ms: Callable[[], float] = lambda: time.monotonic() * 1000,
    ) -> None:
        # valkey is imported here, not at the top: a gateway without a store never pays its ~0.1 s of CPU.
        import valkey.asyncio as valkey_asyncio
        from valkey.asyncio.sentinel import Sentinel

        parsed = parse_store_address(address)
        self.address = address
        self.prefix = prefix
        self.gateway_id = gateway_id
        self.timeout_s = timeout_s
        self._ttl_ms = max(1, math.ceil(ttl_s * 1000))
        # How often the gateways that get the remainder of max_in_flight / live change.
        self._rotation_ms = max(1, math.ceil(share_rotation_s * 1000))
        # No client-side retries: a failed sync is retried at the next interval, after the
        # gateway has fallen back, never while admission waits on it.
        if parsed.direct is not None:
            self._client = valkey_asyncio.Valkey(
                host=parsed.direct[0], port=parsed.direct[1], socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s, retry_on_timeout=False, retry=None,
            )
        else:
            # The sentinels name the primary at each new connection; a failover breaks the old ones
            # (the sync fails, the gateway falls back for an interval) and the next sync reaches the new.
            sentinel = Sentinel(list(parsed.sentinels), socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            self._client = sentinel.master_for(
                parsed.primary_name, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                retry_on_timeout=False, retry=None,
            )
        self._script = self._client.register_script(_SYNC_SCRIPT)
        self._clock_ms = clock_ms
        # The store's clock minus ours (ms), from the last reply; None before the first.
        self._store_offset_ms: float | None = None

    def keys_of(self, tenant_id: str) -> tuple[str, str, str]:
        base = f"{self.prefix}t:{tenant_id}:"
        return (base + "requests", base + "tokens", base + "in_flight")

    async def sync(self, plan: LeasePlan, *, leaving: bool = False) -> LeaseReply:
        keys = [self.prefix + _GATEWAY_KEY]
        asks = []
        for ask in plan.asks:
            keys.extend(self.keys_of(ask.tenant_id))
            quota = ask.quota
            asks.append((
                quota.requests_per_s, quota.requests_burst, ask.return_requests, ask.want_requests, ask.floor_requests,
                quota.tokens_per_s, quota.tokens_burst, ask.return_tokens, ask.want_tokens, ask.floor_tokens,
                quota.max_in_flight, ask.num_in_flight, ask.want_in_flight,
            ))
        # One JSON argument rather than eleven per tenant: packing thousands of arguments cost
        # the client more than the whole script cost the server (bench/bench_quota_store.py).
        sent_ms = self._clock_ms()
        raw = await self._script(keys=keys, args=[self.gateway_id, self._ttl_ms, json.dumps(asks), self._rotation_ms,
                                                  int(leaving), self._deadline_ms(sent_ms)])
        try:
            reply, store_now_ms = _parse_reply(raw, plan)
        except LateSync as late:  # e.g. the store's clock stepped forward: the next deadline follows it
            self._store_offset_ms = late.store_now_ms - self._clock_ms()
            raise
        # The store's clock against ours, as of this reply (off by at most the reply's travel time).
        self._store_offset_ms = store_now_ms - self._clock_ms()
        return reply

    def _deadline_ms(self, sent_ms: float) -> int:
        """When, on the store's clock, this gateway stops waiting for a sync sent now (0: not known
        yet, before the first reply)."""
        if self._store_offset_ms is None:
            return 0
        return int(sent_ms + self._store_offset_ms + self.timeout_s * 1000)

    async def audit(self, known_tenants: Iterable[str]) -> list[str]:
        """Keys under the prefix that no gateway of this tenants file would write (foreign or
        stale tenants, other layouts). Read-only: they are reported, never trusted, never deleted."""
        known = set(known_tenants)
        strange: list[str] = []
        async for raw_key in self._client.scan_iter(match=_glob_escape(self.prefix) + "*", count=500):
            key = raw_key.decode(errors="replace") if isinstance(raw_key, bytes) else str(raw_key)
            rest = key[len(self.prefix):]
            match = _TENANT_KEY.match(rest)
            if rest == _GATEWAY_KEY or (match and match["tenant"] in known):
                continue
            strange.append(key)
        return strange

    async def close(self) -> None:
        await self._client.aclose()


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _parse_reply(raw: object, plan: LeasePlan) -> tuple[LeaseReply, float]:
    """The reply, and the store's time when it ran the sync (ms)."""
    if isinstance(raw, list) and len(raw) == 2 and raw[0] in (b"late", "late"):
        raise LateSync(_store_time_ms(raw[1]))
    if not (isinstance(raw, list) and len(raw) == 4 and isinstance(raw[1], list)):
        raise StoreReplyError(f"unexpected sync reply shape: {str(raw)[:200]}")
    live, bad, encoded, store_now_ms = raw
    try:
        values = json.loads(encoded)
    except (TypeError, ValueError) as exc:
        raise StoreReplyError(f"sync reply grants are not JSON: {exc}") from None
    if values == {}:  # cjson encodes an empty Lua table as an object: no tenants
        values = []
    if not isinstance(values, list):
        raise StoreReplyError(f"sync reply grants are not a list: {str(values)[:200]}")
    if len(values) != 3 * len(plan.asks):
        raise StoreReplyError(f"sync reply has {len(values)} grant values for {len(plan.asks)} tenants")
    try:
        numbers = [float(v) for v in values]
        num_live = int(live)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreReplyError(f"sync reply holds a value that is not a number: {exc}") from None
    grants = []
    for index, ask in enumerate(plan.asks):
        requests, tokens, slots = numbers[3 * index: 3 * index + 3]
        # The script never grants more than asked (slots: than the quota); the clamp keeps a broken
        # store from doing so.
        grants.append(TenantGrant(
            tenant_id=ask.tenant_id,
            requests=min(max(0.0, requests), max(ask.want_requests, ask.floor_requests)),
            tokens=min(max(0.0, tokens), max(ask.want_tokens, ask.floor_tokens)),
            in_flight_limit=int(min(max(0.0, slots), ask.quota.max_in_flight)),
        ))
    bad_keys = tuple(b.decode(errors="replace") if isinstance(b, bytes) else str(b) for b in bad)
    return LeaseReply(num_live_gateways=num_live, grants=tuple(grants), bad_keys=bad_keys), _store_time_ms(store_now_ms)


def _store_time_ms(value: object) -> float:
    try:
        store_now_ms = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        store_now_ms = math.nan
    if not math.isfinite(store_now_ms):
        raise StoreReplyError(f"sync reply's store time is not a number: {str(value)[:40]}")
    return store_now_ms
