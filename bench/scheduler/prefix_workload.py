"""The prefix-cache benchmark's workload, scaled down from llm-d's prefix-cache scorer benchmark
(150 tenants, 6K-token system prompts, multi-turn chats): pure, seeded, no I/O.

Each tenant has its own system prompt; conversations arrive open-loop (Poisson), each of one
tenant, and every turn resends the whole history (system prompt, earlier user turns and the
model's answers) plus a short new user turn, as chat clients do. A turn is sent a think time
after the previous answer ended.

`OracleCache` gives the hit rate an infinite, per-tenant cache would reach on the sequences
actually sent: a full block of a prompt is a hit when an earlier sequence of the same tenant (its
prompt, or the answer it generated, which the next turn resends) had the same tokens up to the
end of that block. Like the scheduler's counters it asks about every full block but the one
holding the prompt's last token (that token is always computed: it yields the first output).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

WORDS = (
    "account", "answer", "billing", "cache", "customer", "deadline", "deploy", "engine", "error", "format",
    "gateway", "invoice", "kernel", "latency", "manual", "model", "network", "order", "policy", "queue",
    "refund", "region", "request", "schedule", "service", "shipment", "status", "support", "tenant", "ticket",
    "token", "update", "version", "warranty", "worker", "always", "briefly", "clearly", "never", "politely",
)


@dataclass(frozen=True)
class WorkloadSpec:
    num_tenants: int = 16
    system_prompt_chars: int = 500  # the byte tokenizer: one token per ASCII character
    conversations_per_s: float = 4.0
    duration_s: float = 20.0  # conversations start in [0, duration_s)
    turns: tuple[int, int] = (2, 4)  # per conversation, uniform, inclusive
    user_chars: tuple[int, int] = (16, 40)
    max_tokens: tuple[int, int] = (16, 32)
    think_time_s: float = 0.2  # mean (exponential) between an answer and the next turn
    seed: int = 1

    def __post_init__(self) -> None:
        if self.num_tenants < 1:
            raise ValueError(f"num_tenants must be >= 1, got {self.num_tenants}")
        if self.conversations_per_s <= 0 or self.duration_s <= 0:
            raise ValueError("conversations_per_s and duration_s must be > 0, got "
                             f"{self.conversations_per_s} and {self.duration_s}")
        for name in ("turns", "user_chars", "max_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be 1 <= low <= high, got {low}, {high}")
        if self.think_time_s < 0:
            raise ValueError(f"think_time_s must be >= 0, got {self.think_time_s}")

    def max_prompt_chars(self, max_answer_chars: int) -> int:
        """The longest prompt a conversation can send (its last turn), for the model's max_seq_len."""
        num_turns = self.turns[1]
        per_turn = len(user_line("", "x" * self.user_chars[1])) + max_answer_chars
        return self.system_prompt_chars + num_turns * per_turn


@dataclass(frozen=True)
class Turn:
    user_text: str
    max_tokens: int
    think_s: float  # after the previous answer ended (0 for the first turn)


@dataclass(frozen=True)
class Conversation:
    conversation_id: int
    tenant_id: str
    start_s: float  # from the run's start
    turns: tuple[Turn, ...]


def tenant_ids(num_tenants: int, run_tag: str = "") -> list[str]:
    """`run_tag`: a round's own tenants, so one round never hits a cache an earlier one left behind."""
    return [f"{run_tag}tenant-{index:02d}" for index in range(num_tenants)]


def system_prompt(tenant_id: str, num_chars: int) -> str:
    """The tenant's own system prompt, `num_chars` characters, the same for every call."""
    rng = random.Random(f"system:{tenant_id}")
    text = f"You are the support assistant of {tenant_id}. Rules:"
    while len(text) < num_chars:
        text += " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) + "."
    return text[:num_chars]


def _words(rng: random.Random, num_chars: int) -> str:
    text = ""
    while len(text) < num_chars:
        text += rng.choice(WORDS) + " "
    return text[:num_chars].rstrip() + "?"


def make_conversations(spec: WorkloadSpec, run_tag: str = "") -> list[Conversation]:
    """Poisson conversation starts over [0, spec.duration_s), each of a uniformly drawn tenant."""
    rng = random.Random(spec.seed)
    tenants = tenant_ids(spec.num_tenants, run_tag)
    conversations = []
    start_s = rng.expovariate(spec.conversations_per_s)
    while start_s < spec.duration_s:
        turns = tuple(
            Turn(_words(rng, rng.randint(*spec.user_chars)), rng.randint(*spec.max_tokens),
                 0.0 if index == 0 else rng.expovariate(1 / spec.think_time_s) if spec.think_time_s else 0.0)
            for index in range(rng.randint(*spec.turns))
        )
        conversations.append(Conversation(len(conversations), rng.choice(tenants), start_s, turns))
        start_s += rng.expovariate(spec.conversations_per_s)
    return conversations


def user_line(history: str, user_text: str) -> str:
    return f"{history}\nUser: {user_text}\nAssistant:"


def render_prompt(system: str, exchanges: Sequence[tuple[str, str]], user_text: str) -> str:
    """The prompt of a turn: the system prompt, each earlier (user, answer), then the new user turn.
    A turn's prompt starts with the previous turn's prompt and answer, character for character."""
    history = system
    for earlier_user, answer in exchanges:
        history = user_line(history, earlier_user) + answer
    return user_line(history, user_text)


@dataclass
class OracleCache:
    """An infinite per-tenant cache: the blocks of each prompt, in the order they were sent,
    counted as they would hit."""

    block_size: int
    num_blocks: int = 0  # full blocks asked about (all but the one of each prompt's last token)
    num_hit_blocks: int = 0
    num_tokens: int = 0  # every prompt token
    num_hit_tokens: int = 0
    _seen: set[bytes] = field(default_factory=set)

    def add(self, tenant_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int] = ()) -> int:
        """One sequence, sent after all those added before; returns its prompt's hit blocks."""
        num_asked = (len(prompt_ids) - 1) // self.block_size if prompt_ids else 0
        hashes = list(_chained_hashes(tenant_id, [*prompt_ids, *output_ids], self.block_size))
        num_hits = sum(1 for block_hash in hashes[:num_asked] if block_hash in self._seen)
        self._seen.update(hashes)
        self.num_blocks += num_asked
        self.num_hit_blocks += num_hits
        self.num_tokens += len(prompt_ids)
        self.num_hit_tokens += num_hits * self.block_size
        return num_hits

    def add_all(self, sequences: Iterable[tuple[str, Sequence[int], Sequence[int]]]) -> OracleCache:
        for tenant_id, prompt_ids, output_ids in sequences:
            self.add(tenant_id, prompt_ids, output_ids)
        return self

    @property
    def block_hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_tokens if self.num_tokens else 0.0


def _chained_hashes(tenant_id: str, token_ids: Sequence[int], block_size: int) -> Iterable[bytes]:
    parent = hashlib.blake2b(tenant_id.encode(), digest_size=16).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = b",".join(str(t).encode() for t in token_ids[start:start + block_size])
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        yield parent
