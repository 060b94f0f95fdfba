"""The chat prompts SmolLM2's draft learns from: questions, instructions, code requests and
everyday requests, made from templates x subjects (deterministic, no data set to fetch).

A prompt is held out (never trained on; what τ is measured on) when
sha256(SPLIT_SALT + text) falls in the lowest HELD_OUT share, so the split depends on the
text alone, not on list order.
"""
from __future__ import annotations

import hashlib

SPLIT_SALT = "dflash-ir-smollm2-v1:"
HELD_OUT = 0.1

SUBJECTS = [
    "the water cycle", "photosynthesis", "the French Revolution", "black holes", "healthy sleep",
    "compound interest", "the Roman Empire", "volcanoes", "machine learning", "coffee", "the moon",
    "recycling", "chess", "the human heart", "rainbows", "electric cars", "honey bees",
    "the Great Wall of China", "gardening", "climate change", "vaccines", "the internet", "music theory",
    "the Olympic Games", "dinosaurs", "solar panels", "friendship", "public speaking", "time management",
    "ocean tides",
]
TOPIC_TEMPLATES = [
    "What is {}?", "Why is {} important?", "Describe the role of {} in everyday life.", "Explain {} to a ten-year-old.",
    "What are three surprising facts about {}?", "Write a short paragraph about {}.",
    "Give me three tips related to {}.", "Summarise what you know about {} in two sentences.",
    "Write a haiku about {}.", "I'm preparing a school presentation on {}. Where should I start?",
    "My friend keeps talking about {}. What should I know?",
    "Write a friendly email inviting a colleague to a talk on {}.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a string", "merges two sorted lists",
    "removes duplicates from a list", "finds the largest element of a list", "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome", "sums the digits of an integer", "flattens a nested list",
    "counts word frequencies in a text", "sorts a list of dictionaries by a key",
]
CODE_TEMPLATES = [
    "Write a Python function that {}.", "Write a JavaScript function that {}.",
    "How do I write a function that {} in Python?", "Explain, with code, a function that {}.",
]


def all_prompts() -> list[str]:
    return [t.format(s) for t in TOPIC_TEMPLATES for s in SUBJECTS] + \
        [t.format(task) for t in CODE_TEMPLATES for task in CODE_TASKS]


def held_out(text: str) -> bool:
    digest = hashlib.sha256((SPLIT_SALT + text).encode()).digest()
    return int.from_bytes(digest[:8], "big") < HELD_OUT * 2**64


def split() -> dict[str, list[str]]:
    """{"train": [...], "held_out": [...]}, each in all_prompts() order."""
    prompts = all_prompts()
    return {"train": [p for p in prompts if not held_out(p)], "held_out": [p for p in prompts if held_out(p)]}
