"""The speculative-decoding benchmark's prompts: code, extraction, chat and creative, two of
each (tools/spec/speedup, and the SmolLM2 test that checks speculation through a cluster)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchPrompt:
    name: str
    kind: str  # code | extraction | chat | creative
    text: str


PROMPTS: tuple[BenchPrompt, ...] = (
    BenchPrompt("fix-typo", "code",
                "Fix the typo in this Python code and show the corrected code:\n\n```python\n"
                "def area(width, height):\n    retrun width * height\n```"),
    BenchPrompt("docstring", "code",
                "Add a docstring to this Python function:\n\n```python\ndef greet(name):\n"
                "    message = 'Hello, ' + name\n    print(message)\n    return message\n```"),
    BenchPrompt("contact-json", "extraction",
                "Extract the name, email address and phone number from this text as JSON "
                "with the keys name, email and phone.\n\nText: Please contact Maria Lopez at "
                "maria.lopez@example.com or call her at 555-0142 about the quarterly report."),
    BenchPrompt("cities", "extraction",
                "List every city mentioned in this paragraph, one per line:\n\nOur tour "
                "starts in Paris, continues by train to Lyon and Marseille, then flies to "
                "Rome, Florence and Venice, and ends in Vienna."),
    BenchPrompt("tea", "chat", "How do I make a good cup of tea?"),
    BenchPrompt("fridge", "chat", "Explain how a refrigerator keeps food cold."),
    BenchPrompt("lighthouse", "creative",
                "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    BenchPrompt("autumn", "creative", "Write a poem about autumn leaves."),
)
