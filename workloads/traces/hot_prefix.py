"""A generated hot-prefix-skew trace: many users under a few system prompts, picked by a Zipf law (RFC phase 3b).

Each user is a multi-turn session: its prompts are BOS, one of ``prompts`` system prompts (prompt ``k`` chosen with
probability proportional to ``1 / (k+1)**zipf_s``), then its turns (user message, model output) so far; call ``i``
re-sends everything before it, so its prompt starts with call ``i-1``'s prompt and output (the text-trace invariant).
Users arrive as a Poisson process of ``users_per_s``; a user's next turn comes ``think_s`` (exponential mean) after
the previous call's output would have finished under the default service model. Every length and token is drawn from
one ``numpy`` generator seeded with ``seed``, so a trace is a pure function of its parameters.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from workloads.service import ServiceModel
from workloads.traces.swe_agent import Trajectory
from workloads.traces.text_trace import CallInfo, TextTrace

VOCAB = 32_000


@dataclasses.dataclass(frozen=True)
class HotPrefixSkew:
    users: int = 1000
    prompts: int = 8
    zipf_s: float = 1.1
    system_tokens: tuple[int, int] = (1500, 3000)
    user_tokens: tuple[int, int] = (50, 400)
    output_tokens: tuple[int, int] = (50, 300)
    turns: tuple[int, int] = (1, 6)
    users_per_s: float = 2.0
    think_s: float = 5.0
    seed: int = 0

    def trace(self, limit: int | None = None) -> TextTrace:
        """The first ``limit`` users (all by default) as a ``TextTrace`` (one session per user)."""
        rng = np.random.default_rng(self.seed)
        span = lambda lo_hi: int(rng.integers(lo_hi[0], lo_hi[1] + 1))  # noqa: E731
        tokens = lambda n: rng.integers(1, VOCAB, size=n, dtype=np.int32)  # noqa: E731
        systems = [tokens(span(self.system_tokens)) for _ in range(self.prompts)]
        weights = 1.0 / np.arange(1, self.prompts + 1) ** self.zipf_s
        weights /= weights.sum()
        bos = np.zeros(1, dtype=np.int32)
        service, arrival, sessions = ServiceModel(), 0.0, []
        for u in range(self.users if limit is None else min(limit, self.users)):
            arrival += float(rng.exponential(1.0 / self.users_per_s))
            messages = [systems[int(rng.choice(self.prompts, p=weights))]]
            calls, t, prompt_len = [], arrival, 1 + messages[0].size
            for _ in range(span(self.turns)):
                user, out = tokens(span(self.user_tokens)), tokens(span(self.output_tokens))
                messages += [user, out]
                prompt_len += user.size
                calls.append(CallInfo(t, prompt_len, int(out.size)))
                t += service.duration(prompt_len, out.size) + float(rng.exponential(self.think_s))
                prompt_len += out.size
            sessions.append(Trajectory(f"user{u:05d}", bos, messages, calls))
        return TextTrace(f"hot-prefix(users={self.users}, prompts={self.prompts}, zipf_s={self.zipf_s}, "
                         f"seed={self.seed})", "hot-prefix", sessions)


def load_hot_prefix(path=None, limit: int | None = None) -> TextTrace:
    """The registry's loader for the generated workload: ``path`` is unused (nothing is read)."""
    return HotPrefixSkew().trace(limit)
