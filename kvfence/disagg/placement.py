"""Where the router sends a request: what it knows of each worker (its hello: pool, window, page size),
which workers are down, and the tokens it has in flight on each.

Contract: `choose` is invariant 3 across processes. It refuses (AdmissionError) before anything is
reserved unless a reachable pair exists, the request fits the window and, isolation on, the chosen pair's
pools, each compared alone, never summed: a request's KV lives in one prefill and one decode worker. Of
the workers that fit, each role's pick is the one with room for the request now (headroom: capacity minus
the tokens of the requests in flight there, at least what the request needs) and, among those, the least
loaded by the router's own count of tokens in flight; when none has room, the one with the most headroom.
The first listed wins a tie, so the choice is deterministic. `take` and `release` keep those tokens;
nothing here sends a message.

Why headroom counts only up to the request's need: a capacity is the worker's own claim (`replies.worker`
caps it, but cannot know the real pool). Ranked by raw headroom, a worker claiming a pool far larger than
the others' would take every request until its claim was spent, other tenants' prompts included. Capped,
a claim buys nothing beyond "this request fits": requests spread by what the router itself sent, and a
larger claim only draws what the honest workers cannot hold now. The price: an honest larger pool is no
longer preferred while a smaller one still has room (tokens in flight even out, then the larger pool
takes what the smaller cannot hold).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvfence.engine.engine import AdmissionError, context_refusal


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as its hello (over the authenticated channel) describes it, checked by `replies.worker`."""

    role: str
    capacity_tokens: int
    max_model_len: int
    page_size: int
    isolation: bool
    info: dict[str, Any]  # the worker's engine_info (bounded pins), for /v1/audit/info


@dataclass
class Route:
    """One request's pair of workers and the tokens it counts against each until it ends."""

    prefill: str
    decode: str
    prefill_tokens: int  # released at decode's first output: by then prefill has sent its pages
    decode_tokens: int


class Placement:
    """The router's placement state. `by_role`: role -> worker addresses in the order given; `names`:
    address -> worker name. Callers on the event loop and on the router's I/O thread share it: `down` is
    written by the I/O thread only, `routes` and `load` by the event loop only."""

    def __init__(self, by_role: dict[str, list[str]], names: dict[str, str], isolation: bool) -> None:
        self.by_role, self.names, self.isolation = by_role, names, isolation
        self.workers: dict[str, WorkerInfo] = {}  # by worker name, from each hello
        self.down: set[str] = set()  # addresses whose link is lost now
        self.no_kv: dict[str, str] = {}  # address -> why it refused KV (kv_refusal), until its next hello
        self.routes: dict[str, Route] = {}  # requests in flight -> their pair
        self.load: Counter[str] = Counter()  # address -> tokens of the requests in flight there
        self.routed: Counter[str] = Counter()  # worker name -> requests sent to it, since start
        self.max_model_len = 0

    def mismatch(self) -> str | None:
        """Why these workers cannot serve together (a page moves whole, as bytes: one page size and one KV
        dtype), else None."""
        for what, of in (
            ("page sizes", lambda w: w.page_size),
            ("KV dtypes", lambda w: w.info.get("kv_cache_dtype")),
        ):
            values = {name: of(worker) for name, worker in self.workers.items()}
            if len(set(values.values())) > 1:
                return f"{what} differ: " + ", ".join(f"{name} {value}" for name, value in values.items())
        return None

    def adopt(self, name: str, worker: WorkerInfo) -> str | None:
        """A reconnected worker's hello: its pool and window are admission's from now on, so a worker
        restarted with a smaller pool is never sent what only the old one could hold. Why it cannot serve
        beside the others (`mismatch`: a restarted pool holding another KV dtype, say), the previous kept."""
        previous, self.workers[name] = self.workers[name], worker
        problem = self.mismatch()
        if problem is not None:
            self.workers[name] = previous
            return problem
        self.max_model_len = self.window()
        return None

    def window(self) -> int:
        """The advertised window: every pair must serve it, so the smallest. With isolation off the
        decode workers' alone, as the incident's deployment did."""
        roles = ("prefill", "decode") if self.isolation else ("decode",)
        return min(self.info(a).max_model_len for role in roles for a in self.by_role[role])

    def info(self, address: str) -> WorkerInfo:
        return self.workers[self.names[address]]

    def choose(self, prompt: int, budget: int) -> Route:
        """Invariant 3 across processes: a reachable pair, the window, and (isolation on) that pair's
        pools, before any reservation; AdmissionError otherwise. With isolation off only the window is
        checked, as the incident's router did."""
        for role in ("decode", "prefill"):  # a lost role answers 503 at once, not after its restart
            if all(address in self.down or address in self.no_kv for address in self.by_role[role]):
                message = f"The {role} worker is unreachable; retry later."
                raise AdmissionError(f"{role}_unavailable", message, 503)
        window = [("This model's maximum context length is", self.max_model_len, prompt + budget)]
        refusal = context_refusal(prompt, budget, window)
        if refusal is not None:
            raise refusal
        prefill = self._pick("prefill", prompt, budget, prompt)
        decode = self._pick("decode", prompt, budget, prompt + budget)
        return Route(prefill, decode, prompt, prompt + budget)

    def _pick(self, role: str, prompt: int, budget: int, need: int) -> str:
        """The reachable `role` worker whose pool holds `need` tokens: of those with room for it now the
        least loaded, else the one with the most headroom (first listed on a tie). A pool is compared
        alone, never summed: the request's KV lives in one worker."""
        known = [a for a in self.by_role[role] if self.names[a] in self.workers]
        fits = [a for a in known if not self.isolation or need <= self.info(a).capacity_tokens]
        if not fits:
            largest = max(self.info(a).capacity_tokens for a in known)
            refusal = context_refusal(prompt, budget, [(f"The {role} KV pool holds", largest, need)])
            assert refusal is not None
            raise refusal
        up = [a for a in fits if a not in self.down and a not in self.no_kv]
        if not up:
            raise AdmissionError(
                f"{role}_unavailable", f"The {role} worker is unreachable; retry later.", 503
            )
        # Headroom beyond `need` is only claimed: it ranks no worker above another (module docstring).
        return max(up, key=lambda a: (min(self.info(a).capacity_tokens - self.load[a], need), -self.load[a]))

    def health(self) -> dict[str, str]:
        """Each worker by name: `up`, `down` (its link is lost) or why it takes no KV (/health shows it)."""
        return {
            self.names[a]: "down" if a in self.down else self.no_kv.get(a, "up")
            for addresses in self.by_role.values()
            for a in addresses
        }

    def take(self, request_id: str, route: Route) -> None:
        self.routes[request_id] = route
        self.load[route.prefill] += route.prefill_tokens
        self.load[route.decode] += route.decode_tokens
        self.routed.update((self.names[route.prefill], self.names[route.decode]))

    def release_prefill(self, route: Route) -> None:
        self.load[route.prefill] -= route.prefill_tokens
        route.prefill_tokens = 0

    def release(self, request_id: str, route: Route) -> None:
        self.release_prefill(route)
        self.load[route.decode] -= route.decode_tokens
        route.decode_tokens = 0
        self.routes.pop(request_id, None)
