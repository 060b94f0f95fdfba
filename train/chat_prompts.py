"""The chat prompts SmolLM2's draft learns from: questions, instructions, code requests and
everyday requests, made from templates x subjects (deterministic, no data set to fetch).

A prompt is held out (never trained on; what τ is measured on) when
sha256(SPLIT_SALT + text) falls in the lowest HELD_OUT share, so the split depends on the
text alone, not on list order. The first set (V1: 416 prompts, 54 held out) comes first; the
second (V2: more subjects, templates and code tasks, every combination V1 lacks) follows, so
`held_out[:54]` are the prompts earlier measurements used.
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


V2_SUBJECTS = SUBJECTS + [
    "the printing press", "earthquakes", "the immune system", "bread baking", "the stock market", "penguins",
    "the Renaissance", "wind energy", "meditation", "the periodic table", "ancient Egypt", "rainforests",
    "cryptography", "the solar system", "bicycles", "democracy", "the Silk Road", "jazz", "tea", "the brain",
    "glaciers", "electricity", "the Industrial Revolution", "origami", "whales", "budgeting", "nutrition",
    "the speed of light", "volunteering", "board games", "the Amazon River", "bridges", "language learning",
    "inflation", "hurricanes", "cheese", "the telescope", "mountains", "social media", "yoga",
    "the Moon landing", "deserts", "batteries", "the Vikings", "composting", "earth's magnetic field",
    "antibiotics", "chocolate", "libraries", "robots", "coral reefs", "marathon running",
    "the human eye", "trains", "poetry", "the Pyramids of Giza", "wolves", "saving money", "thunderstorms",
    "the piano", "DNA", "airplanes", "mushrooms", "camping", "the Eiffel Tower", "statistics",
    "first aid", "butterflies", "the ozone layer", "writing a resume",
]
V2_TOPIC_TEMPLATES = TOPIC_TEMPLATES + [
    "How does {} work?", "What is the history of {}?", "List five key words related to {}.",
    "What are the pros and cons of {}?", "Tell me a short story involving {}.",
    "What questions should I ask an expert on {}?",
]
V2_CODE_TASKS = CODE_TASKS + [
    "checks whether two strings are anagrams", "computes the greatest common divisor of two numbers",
    "reads a file and counts its lines", "returns the second largest number in a list",
    "converts a decimal number to binary", "capitalises every word in a sentence",
    "finds the intersection of two lists", "computes the average of a list of numbers",
    "checks whether a year is a leap year", "splits a list into chunks of size n",
    "finds the longest word in a sentence", "rotates a list by k positions",
    "counts the occurrences of each character in a string", "checks whether brackets in a string are balanced",
    "computes the power set of a list", "implements binary search on a sorted list",
]
V2_CODE_TEMPLATES = CODE_TEMPLATES + ["Write a C function that {}.", "Show me a short Rust function that {}."]


def _prompts(topic_templates, subjects, code_templates, code_tasks) -> list[str]:
    return [t.format(s) for t in topic_templates for s in subjects] + \
        [t.format(task) for t in code_templates for task in code_tasks]


def all_prompts() -> list[str]:
    v1 = _prompts(TOPIC_TEMPLATES, SUBJECTS, CODE_TEMPLATES, CODE_TASKS)
    known = set(v1)
    return v1 + [p for p in _prompts(V2_TOPIC_TEMPLATES, V2_SUBJECTS, V2_CODE_TEMPLATES, V2_CODE_TASKS)
                 if p not in known]


def held_out(text: str) -> bool:
    digest = hashlib.sha256((SPLIT_SALT + text).encode()).digest()
    return int.from_bytes(digest[:8], "big") < HELD_OUT * 2**64


def split() -> dict[str, list[str]]:
    """{"train": [...], "held_out": [...]}, each in all_prompts() order."""
    prompts = all_prompts()
    return {"train": [p for p in prompts if not held_out(p)], "held_out": [p for p in prompts if held_out(p)]}
