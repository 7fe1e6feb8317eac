"""Telling a request log from a conversation log by what the lines hold, not by how they end.

A request log re-sends history: a session's next request starts with every message of its previous request (and,
when the log holds it, the reply). A conversation log holds each conversation once, on one line. So:

1. some line's messages start with all of an earlier line's messages (and go on): a request log;
2. else some line holds earlier turns (a message after an assistant reply): a conversation log, whatever its last
   turn (a conversation often closes with the user's last message);
3. else every line is a single exchange (messages, then at most the reply): a request log, each line one request;
   read as conversations the same prompts are replayed, less the lines without a reply.

``tell_kind`` returns the reading and the reason in words, for the replay's header: cases 2 and 3 are the file not
saying for sure, and the header names the ``--format`` that reads it the other way.
"""

from __future__ import annotations

REQUESTS, CONVERSATIONS = "openai-requests", "openai-conversations"
OTHER = {REQUESTS: CONVERSATIONS, CONVERSATIONS: REQUESTS}


def _resent(convs: list[list[tuple[str, str]]]) -> int:
    """How many lines start with every message of an earlier, shorter line."""
    seen: dict[int, list[int]] = {}  # hash of a line's whole message list -> indices of the lines with it
    count = 0
    for j, conv in enumerate(convs):
        h, found = 0, False
        for k in range(len(conv) - 1):  # proper prefixes only: a repeated line says nothing
            h = hash((h, conv[k]))
            if not found and any(convs[i] == conv[:k + 1] for i in seen.get(h, ())):  # the hash nominates, == decides
                found = True
        count += found
        whole = hash((h, conv[-1])) if conv else 0
        seen.setdefault(whole, []).append(j)
    return count


def tell_kind(convs: list[list[tuple[str, str]]]) -> tuple[str, str]:
    """``(kind, why)`` of an OpenAI-style log's conversations (``[(role, text)]`` per line), by the module's rules."""
    lines = sum(1 for c in convs if c)
    if resent := _resent(convs):
        return REQUESTS, f"{resent:,} of {lines:,} lines re-send an earlier line's messages"
    history = sum(1 for c in convs if any(role == "assistant" for role, _ in c[:-1]))
    if history:
        return CONVERSATIONS, (f"no line re-sends an earlier line's messages, and {history:,} of {lines:,} hold "
                               "earlier turns of their conversation")
    return REQUESTS, ("no line re-sends an earlier line's messages or holds earlier turns: each line is one exchange, "
                      "replayed as one request")
