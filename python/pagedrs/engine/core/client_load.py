"""What an engine core reports of each client's load when several API servers route over it: per client,
its requests in flight and their prompt tokens still to prefill, the measure the data-parallel router
keeps for its own requests (`pagedrs.engine.dp.router`), so that a frontend adds the other frontends'
load to its own in one unit."""

from __future__ import annotations

from dataclasses import dataclass

from pagedrs.engine.core.messages import ClientLoad, EngineCoreOutput

__all__ = ["ClientLoadTracker"]


@dataclass(slots=True)
class _Request:
    client: int
    prompt_tokens: int
    prefill: int  # prompt tokens still to prefill


class ClientLoadTracker:
    """Per client: requests in flight on this core and their prompt tokens still to prefill.

    A request counts every prompt token when added; the step that first schedules it reports how many
    were cached (`num_cached_tokens`) and takes those off; its first output token (or its pooled
    embedding) ends its prefill. A recomputation after preemption is not counted again, as the router
    does not count it."""

    def __init__(self, num_clients: int) -> None:
        self._requests: dict[str, _Request] = {}
        self._counts = [0] * num_clients
        self._prefill = [0] * num_clients

    def add(self, request_id: str, client: int, prompt_tokens: int) -> None:
        """A request from `client` (one already tracked under this id is replaced)."""
        self.forget(request_id)
        self._requests[request_id] = _Request(client, prompt_tokens, prompt_tokens)
        self._counts[client] += 1
        self._prefill[client] += prompt_tokens

    def forget(self, request_id: str) -> int | None:
        """The request left the core (finished, aborted, rejected): its client, or None if unknown."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self._counts[req.client] -= 1
        self._prefill[req.client] -= req.prefill
        return req.client

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def client_of(self, request_id: str) -> int | None:
        req = self._requests.get(request_id)
        return None if req is None else req.client

    def observe(self, out: EngineCoreOutput) -> None:
        """One step's news of a request: its cached prefix, or the end of its prefill."""
        req = self._requests.get(out.request_id)
        if req is None or req.prefill == 0:
            return
        left = req.prefill
        if out.new_token_ids or out.embedding is not None or out.finish_reason is not None:
            left = 0
        elif out.num_cached_tokens is not None:
            left = min(left, max(0, req.prompt_tokens - out.num_cached_tokens))
        self._prefill[req.client] -= req.prefill - left
        req.prefill = left

    def loads(self) -> list[ClientLoad]:
        return [ClientLoad(n, p) for n, p in zip(self._counts, self._prefill, strict=True)]
