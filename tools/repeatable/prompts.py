"""The prompts every case sends: 20 of varied lengths, some sharing a long start (a system
prompt, a document asked about twice), one of a single word."""

from __future__ import annotations

SYSTEM = ("You are a careful assistant. Answer in plain English, briefly and precisely, and "
          "say so when you do not know. ")
DOCUMENT = ("The lighthouse stood on a rock a mile from the coast. Its keeper climbed the "
            "hundred and twelve steps at dusk to light the lamp, wound the clockwork that "
            "turned the lens, and wrote the weather, the ships and the birds in a logbook "
            "every hour until dawn. In winter the storms threw spray over the gallery, and "
            "supplies came by boat once a fortnight when the sea allowed. ") * 3

PROMPTS: tuple[str, ...] = (
    "List three primary colors.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Name a famous physicist and say why they matter.",
    "Count from one to ten.",
    "Give me a recipe for pancakes.",
    "What is 12 times 7?",
    "Why is the sky blue?",
    "Hi",
    SYSTEM + "What is a prime number?",
    SYSTEM + "Name two planets.",
    SYSTEM + "How do bees make honey?",
    SYSTEM + "What is rain?",
    DOCUMENT + "\nWhat did the keeper write in the logbook?",
    DOCUMENT + "\nHow often did supplies come?",
    DOCUMENT + "\nSummarise the text in one sentence.",
    "Summarise: the quick brown fox jumps over the lazy dog; the dog wakes, chases the fox "
    "into the woods, and both get lost until the farmer finds them at night.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Write a limerick about a cat who learns to code.",
)

FOLLOW_UP = "And then? Say more."
