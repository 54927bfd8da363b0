"""Structured output: constraints compiled to token grammars (llguidance) and enforced while sampling.

``spec`` turns a ``pdserve.sampling.Constraint`` into llguidance's grammar text and bounds what it may
cost; ``compiler`` holds the vocabulary and the compiled grammars (cached by their text); ``state`` is
one request's position in its grammar; ``masks`` computes a batch's allowed tokens on the host and
applies them to the logits on the device. docs/structured-output.md says why llguidance and what is
measured.
"""

from engine.grammar.compiler import GrammarCompiler
from engine.grammar.spec import GrammarError
from engine.grammar.state import GrammarState

__all__ = ["GrammarCompiler", "GrammarError", "GrammarState"]
