"""One request's place in its grammar: the tokens it generated so far, consumed by its own matcher.

The matcher only ever sees real tokens, in order: ``engine.stopping.append_token`` feeds each generated
token once it is on the host (a step launched ahead holds a placeholder until then, and the row's mask
waits for it, ``engine.model_runner.LaunchedStep.finish``). A request that resumes elsewhere -- the
decode side of a disaggregated request, a continuation the router migrated -- replays the tokens it
generated before (the prefill worker's first token, ``SamplingParams.stop_context``) into a fresh
matcher, so it stands exactly where a single engine's would.
"""

from __future__ import annotations

from engine.grammar.spec import GrammarError


class GrammarState:
    def __init__(self, matcher, kind: str) -> None:
        self.matcher = matcher
        self.kind = kind
        self.tokens = 0  # tokens consumed

    @property
    def done(self) -> bool:
        """The grammar is complete (nothing but its end can follow). A matcher in its error state (a
        grammar limit hit while computing a mask) is not done: its mask allows only EOS, which it then
        refuses, so the request ends with the error (``accept``)."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def replay(self, tokens) -> None:
        """Consume tokens generated before this matcher existed; GrammarError when the constraint
        rejects them (a continuation whose earlier answer does not follow it)."""
        tokens = list(tokens)
        if tokens and not self.matcher.consume_tokens(tokens):
            raise GrammarError(f"the tokens already generated do not follow the {self.kind} constraint: "
                               f"{self.matcher.get_error()}")
        self.tokens += len(tokens)

    def accept(self, token: int) -> bool:
        """Consume a sampled token; True when the answer is complete with it. GrammarError when the
        matcher refuses it (only a token sampled without the mask could be)."""
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} breaks the {self.kind} constraint: {self.matcher.get_error()}")
        self.tokens += 1
        return self.matcher.is_stopped()
